# With a mask (config key `mask`): which tasks a non-zero mask voxel overlaps depends on the data,
# so one checkpoint lists them; jobs batch only those tasks, the others are recorded masked.


checkpoint mask_tasks:
    input:
        run=flagged(f"{WORK}/run.json"),
        layer=f"{WORK}/layer.json",
    output:
        flagged(f"{WORK}/mask_tasks.json"),
    params:
        env=ZNNI_ENV,
    conda:
        "../workflow/envs/znni.yaml"
    container:
        CONTAINER
    log:
        f"{WORK}/logs/mask_tasks.log",
    shell:
        f"{{params.env}} znni mask-tasks {RUN_FILE} {MASK_OUTPUT} > {{log}} 2>&1{TOUCH}"
