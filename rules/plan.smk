# Validate the configuration against the network and the layers, autotune the plan, then create
# the output layer (info + provenance): once, in one job (a second job cost a process start here
# and a queue wait under SLURM). Everything that can be known to fail fails here, before any task
# is scheduled and before the layer is written.
# Give this rule the same mem_mb and threads as infer_job (the plan is made for that job size).
# The layer directory is never a Snakemake output (Snakemake deletes outputs before a job runs):
# layer.json is its marker.


rule validate:
    input:
        SCHEDULE_FILE,
        CONFIG_FILE,
    output:
        run=flagged(f"{WORK}/run.json"),
        plan=flagged(f"{WORK}/plan.json"),
        layer=f"{WORK}/layer.json",
    params:
        env=ZNNI_ENV,
        config=CONFIG_JSON,
    conda:
        "../workflow/envs/znni.yaml"
    container:
        CONTAINER
    log:
        f"{WORK}/logs/validate.log",
    threads: 1
    resources:
        mem_mb=2000,
    shell:
        "{params.env} znni validate --config-json {params.config:q} --memory {resources.mem_mb}MiB --threads {threads} "
        f"--layer-marker {{output.layer}} > {{log}} 2>&1{TOUCH}"
