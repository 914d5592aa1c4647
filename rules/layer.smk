# Create the output layer (info + provenance) once, before any task.
# The layer directory is never a Snakemake output (Snakemake deletes outputs before a job runs).


rule create_layer:
    input:
        run=f"{WORK}/run.json",
    output:
        f"{WORK}/layer.json",
    params:
        env=ZNNI_ENV,
    conda:
        "../workflow/envs/znni.yaml"
    log:
        f"{WORK}/logs/create_layer.log",
    shell:
        "{params.env} znni create-layer {input.run} --marker {output} > {log} 2>&1"
