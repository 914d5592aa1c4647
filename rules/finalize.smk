# Check every manifest (and every chunk's checksum), append provenance, write the report.


rule finalize:
    input:
        run=f"{WORK}/run.json",
        manifests=get_manifests,
        pyramid=[f"{WORK}/pyramid.json"] if config.get("downsample", {}).get("mips", 0) else [],
    output:
        summary=f"{WORK}/report/summary.json",
        report=f"{WORK}/report/report.html",
        preview=f"{WORK}/report/preview.png",
    conda:
        "../workflow/envs/znni.yaml"
    log:
        f"{WORK}/logs/finalize.log",
    shell:
        "znni finalize {input.run} > {log} 2>&1; rc=$?; cat {log} >&2; exit $rc"
