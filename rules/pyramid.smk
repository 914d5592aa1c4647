# Optional (downsample.mips > 0): mips 1..N of the output, in jobs of tasks of whole shards (or
# chunks); mip k's jobs start once every job of mip k-1 is done (mip 0: the inference jobs).
# `znni pyramid` then checks every mip's manifests and stored objects and writes pyramid.json.
# Each refuses a mip below with a task not done; a task is done while what it pinned of the mip
# below is what that mip's manifests record (docs/pipeline.md#pyramid).


rule pyramid_job:
    input:
        run=flagged(f"{WORK}/run.json"),
        below=get_pyramid_below,
    output:
        flagged(f"{WORK}/pyramid/mip{{mip}}/{{job}}.json"),
    params:
        env=ZNNI_ENV,
        per_job=lambda w: SCHEDULE["pyramid"][int(w.mip) - 1]["tasks_per_job"],
    conda:
        "../workflow/envs/znni.yaml"
    container:
        CONTAINER
    log:
        f"{WORK}/logs/pyramid/mip{{mip}}/{{job}}.log",
    threads: 1
    resources:
        mem_mb=2000,
    shell:
        f"{{params.env}} znni pyramid {RUN_FILE} --mip {{wildcards.mip}} --job {{wildcards.job}} "
        f"--tasks-per-job {{params.per_job}} {MARKER} > {{log}} 2>&1{TOUCH}"


rule pyramid:
    input:
        run=flagged(f"{WORK}/run.json"),
        jobs=get_pyramid_markers,
    output:
        flagged(f"{WORK}/pyramid.json"),
    params:
        env=ZNNI_ENV,
    conda:
        "../workflow/envs/znni.yaml"
    container:
        CONTAINER
    log:
        f"{WORK}/logs/pyramid.log",
    shell:
        f"{{params.env}} znni pyramid {RUN_FILE} > {{log}} 2>&1; rc=$?; cat {{log}} >&2; (exit $rc){TOUCH}"
