# One job per task (many whole output chunks). Its only output is the task manifest, written after
# every chunk was written atomically and verified. To redo one task:
#   snakemake --profile profiles/local --force <work_dir>/manifests/000012.json
# (only that task's chunks are rewritten), then `snakemake --profile profiles/local` refreshes the report.


rule infer_task:
    input:
        run=f"{WORK}/run.json",
        plan=f"{WORK}/plan.json",
        layer=f"{WORK}/layer.json",
        tasks=f"{WORK}/tasks.json",
    output:
        f"{WORK}/manifests/{{task}}.json",
    conda:
        "../workflow/envs/znni.yaml"
    log:
        f"{WORK}/logs/tasks/{{task}}.log",
    benchmark:
        f"{WORK}/benchmarks/tasks/{{task}}.tsv"
    threads: 1
    resources:
        mem_mb=2000,
    shell:
        "znni run-task {input.run} --task {wildcards.task} --mem-mb {resources.mem_mb} --no-progress > {log} 2>&1"
