# Optional (downsample.mips > 0): mips 1..N of the output built by igneous once every task is done,
# each checked against the mean of the mip below; pyramid.json is written only after the checks.


rule pyramid:
    input:
        run=f"{WORK}/run.json",
        jobs=get_job_markers,
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
