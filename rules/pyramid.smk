# Optional (downsample.mips > 0): mips 1..N of the output, in jobs of tasks of whole shards (or
# chunks); mip k's jobs start once every job of mip k-1 is done (mip 0: the inference jobs).
# `znni pyramid` then checks every mip's manifests and stored objects and writes pyramid.json.


def pyramid_markers(mip):
    """Every job marker of mip ``mip`` (the schedule: computed when the workflow is parsed)."""
    s = SCHEDULE["pyramid"][mip - 1]
    return [f"{WORK}/pyramid/mip{mip}/{j:06d}.json" for j in range(s["num_jobs"])]


def get_pyramid_below(wildcards):
    """What a job of a mip reads: all of the mip below."""
    mip = int(wildcards.mip)
    return get_job_markers(wildcards) if mip == 1 else pyramid_markers(mip - 1)


rule pyramid_job:
    input:
        run=f"{WORK}/run.json",
        below=get_pyramid_below,
    output:
        f"{WORK}/pyramid/mip{{mip}}/{{job}}.json",
    params:
        env=ZNNI_ENV,
        per_job=lambda w: SCHEDULE["pyramid"][int(w.mip) - 1]["tasks_per_job"],
    conda:
        "../workflow/envs/znni.yaml"
    log:
        f"{WORK}/logs/pyramid/mip{{mip}}/{{job}}.log",
    threads: 1
    resources:
        mem_mb=2000,
    shell:
        "{params.env} znni pyramid {input.run} --mip {wildcards.mip} --job {wildcards.job} "
        "--tasks-per-job {params.per_job} --marker {output} > {log} 2>&1"


rule pyramid:
    input:
        run=f"{WORK}/run.json",
        jobs=lambda w: [m for s in SCHEDULE["pyramid"] for m in pyramid_markers(s["mip"])],
    output:
        f"{WORK}/pyramid.json",
    params:
        env=ZNNI_ENV,
    conda:
        "../workflow/envs/znni.yaml"
    log:
        f"{WORK}/logs/pyramid.log",
    shell:
        "{params.env} znni pyramid {input.run} > {log} 2>&1; rc=$?; cat {log} >&2; exit $rc"
