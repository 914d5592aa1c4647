# Validate the configuration against the network and the layers, and autotune the plan: once.
# Everything that can be known to fail fails here, before any task is scheduled.
# Give this rule the same mem_mb and threads as infer_job (the plan is made for that job size).


rule validate:
    input:
        SCHEDULE_FILE,
    output:
        run=f"{WORK}/run.json",
        plan=f"{WORK}/plan.json",
    params:
        env=ZNNI_ENV,
        config=CONFIG_JSON,
    conda:
        "../workflow/envs/znni.yaml"
    log:
        f"{WORK}/logs/validate.log",
    threads: 1
    resources:
        mem_mb=2000,
    shell:
        "{params.env} znni validate --config-json {params.config:q} --mem-mb {resources.mem_mb} --threads {threads} > {log} 2>&1"
