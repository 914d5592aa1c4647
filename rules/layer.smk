# Create the output layer (info + provenance) once, before any task; then the task list.
# The layer directory is never a Snakemake output (Snakemake deletes outputs before a job runs).


rule create_layer:
    input:
        run=f"{WORK}/run.json",
    output:
        f"{WORK}/layer.json",
    conda:
        "../workflow/envs/znni.yaml"
    log:
        f"{WORK}/logs/create_layer.log",
    shell:
        "znni create-layer {input.run} --marker {output} > {log} 2>&1"


checkpoint tasks:
    input:
        run=f"{WORK}/run.json",
        layer=f"{WORK}/layer.json",
    output:
        f"{WORK}/tasks.json",
    conda:
        "../workflow/envs/znni.yaml"
    log:
        f"{WORK}/logs/tasks.log",
    shell:
        "znni tasks {input.run} --output {output} > {log} 2>&1"
