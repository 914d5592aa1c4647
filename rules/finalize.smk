# Check every manifest (and every chunk's checksum), append provenance, write the report.


rule finalize:
    input:
        run=f"{WORK}/run.json",
        jobs=get_job_markers,
        pyramid=[f"{WORK}/pyramid.json"] if config.get("downsample", {}).get("mips", 0) else [],
    output:
        summary=f"{WORK}/report/summary.json",
        report=f"{WORK}/report/report.html",
        preview=f"{WORK}/report/preview.png",
    params:
        env=ZNNI_ENV,
    conda:
        "../workflow/envs/znni.yaml"
    log:
        f"{WORK}/logs/finalize.log",
    shell:
        "{params.env} znni finalize {input.run} > {log} 2>&1; rc=$?; cat {log} >&2; exit $rc"
