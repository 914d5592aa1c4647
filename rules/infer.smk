# One job per range of tasks (jobs.tasks_per_job, from the schedule). A task writes and verifies its
# chunks (or its shard), then its manifest; the job's marker comes last. A killed or retried job
# skips the tasks whose manifest and stored objects check out, so only unfinished tasks run again.
# The job's marker records its wall time and peak RSS (no `benchmark:` directive: Snakemake's
# psutil poller took ~8% of a core beside each running job).
# To redo one task or one chunk (its chunks only are rewritten), then refresh the report:
#   znni run-task <work_dir>/run.json --task 12        (or --chunk x0-x1_y0-y1_z0-z1)
#   snakemake --profile profiles/local --forcerun finalize


rule infer_job:
    input:
        run=flagged(f"{WORK}/run.json"),
        plan=flagged(f"{WORK}/plan.json"),
        layer=f"{WORK}/layer.json",
        mask_tasks=MASK_TASKS,
    output:
        flagged(f"{WORK}/jobs/{{job}}.json"),
    params:
        env=ZNNI_ENV,
        per_job=SCHEDULE["tasks_per_job"],
        tasks=get_job_tasks,
        brick=get_job_brick,
    conda:
        "../workflow/envs/znni.yaml"
    container:
        CONTAINER
    log:
        f"{WORK}/logs/jobs/{{job}}.log",
    threads: 1
    resources:
        mem_mb=2000,
    shell:
        f"{{params.env}} znni run-job {RUN_FILE} --job {{wildcards.job}} --tasks-per-job {{params.per_job}} "
        f"{{params.tasks}} {{params.brick}} --memory {{resources.mem_mb}}MiB {MARKER} > {{log}} 2>&1{TOUCH}"
