# Check every manifest (and every chunk's checksum), append provenance, write the report.


rule finalize:
    input:
        run=flagged(f"{WORK}/run.json"),
        jobs=get_job_markers,
        pyramid=[flagged(f"{WORK}/pyramid.json")] if config.get("downsample", {}).get("mips", 0) else [],
    output:
        summary=flagged(f"{WORK}/report/summary.json"),
        report=flagged(f"{WORK}/report/report.html"),
        preview=flagged(f"{WORK}/report/preview.png"),
    params:
        env=ZNNI_ENV,
        # the config's digest: after a change validate refused (Snakemake then deleted its outputs)
        # a re-run is not "nothing to be done" over the other settings' report: it asks again
        config=CONFIG_DIGEST,
    conda:
        "../workflow/envs/znni.yaml"
    container:
        CONTAINER
    log:
        f"{WORK}/logs/finalize.log",
    shell:
        f"{{params.env}} znni finalize {RUN_FILE} > {{log}} 2>&1; rc=$?; cat {{log}} >&2; (exit $rc){TOUCH}"
