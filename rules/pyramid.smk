# Optional (downsample.mips > 0): mips 1..N of the output built by igneous once every task is done,
# each checked against the mean of the mip below; pyramid.json is written only after the checks.


rule pyramid:
    input:
        run=f"{WORK}/run.json",
        manifests=get_manifests,
    output:
        f"{WORK}/pyramid.json",
    conda:
        "../workflow/envs/znni.yaml"
    log:
        f"{WORK}/logs/pyramid.log",
    shell:
        "znni pyramid {input.run} > {log} 2>&1; rc=$?; cat {log} >&2; exit $rc"
