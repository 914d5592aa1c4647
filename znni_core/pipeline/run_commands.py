"""The ``znni`` commands that set a run up and run its steps: validate, estimate, create-layer, tasks,
mask-tasks, run-task, run-job, pyramid, finalize, demo-data.  Each Snakemake rule calls one of them.

Each command imports what it runs when it runs: ``znni --help`` and a rule's command start without
loading the engine (numpy, numba, the layers: about a second).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import numpy as np
import typer

from ..errors import ConfigError, PlanError, ZnniError
from ..io import atomic_write, create_layer, parse_layer_url
from ..io.workdir import is_remote_work
from .cli_base import MEMORY_HELP, RUN_HELP, _deprecated_mem_mb, _log, command, fail, memory_mib
from .demo import write_demo, write_demo_config
from .estimate import describe, estimate, run_estimate
from .identity import check_rerun, previous_identity
from .jobs import run_job
from .mask import mask_tasks_path, scan
from .pyramid import build_pyramid, run_pyramid_job
from .resolve import resolve, task_bytes
from .run import load_run, location, output_specs, run_geometry, save_run
from .schedule import compute_schedule
from .settings import load_config, parse_config


def _create_output_layer(run_file: Path, marker: Optional[Path]) -> None:
    """The output layer's info and provenance, once (an existing layer must match), then ``marker``."""
    # lazy: loads numba and scipy only when called
    from .finalize import output_mapping

    try:
        run = load_run(run_file)
        cfg = run.config
        url = parse_layer_url(run.output.url, endpoint=cfg.output.endpoint_url)
        prov = {
            "description": f"znni dense inference of {Path(run.network.path).name} on {run.input.url}",
            "owners": [],
            "sources": [run.input.url],
            "processing": [
                {
                    "method": {
                        "task": "znni create-layer",
                        "run_digest": run.digest,
                        "output_mapping": output_mapping(cfg),
                    },
                    "by": "znni",
                    "date": run.created,
                }
            ],
        }
        state = create_layer(url, output_specs(run), prov)
    except ZnniError as exc:
        fail(exc)
    _log(f"output layer {url}: {state}")
    if marker:
        atomic_write(
            marker,
            (
                json.dumps(
                    {"layer": str(url), "state": state, "run_digest": run.digest, "info": run.output.info},
                    indent=1,
                )
                + "\n"
            ).encode(),
        )


def _log_estimate(cfg, run, plan) -> None:
    """validate's estimate, at the plan's predicted rate (`znni estimate` measures)."""
    try:
        rate = plan.predicted_voxels_per_s
        e = estimate(
            run.config,
            compute_schedule(cfg, rate=rate),
            rate=rate,
            rate_source="the plan's prediction; `znni estimate` measures",
            threads=plan.threads,
            device=plan.device,
            out_channels=run.network.out_channels,
        )
    except ZnniError as exc:
        _log(f"no estimate: {exc}")
        return
    _log(
        "estimate:\n  "
        + describe(e).replace("\n", "\n  ")
        + (
            "\n  (all tasks: the mask is read by the mask_tasks step; `znni estimate` counts only live work)"
            if run.mask
            else ""
        )
    )


def _check_mem(run, mem_mb, run_geometry, task_bytes):
    """PlanError when the plan's budget and one task's buffers exceed ``mem_mb``; returns the buffers' bytes."""
    _, grid, halo, tasks = run_geometry(run)
    biggest = (tasks.task_chunks * grid.chunk_shape).min(grid.bounds.shape)  # a whole task
    buffers = task_bytes(
        biggest,
        halo,
        run.network.in_channels,
        run.network.out_channels,
        np.dtype(run.input.dtype).itemsize,
        np.dtype(run.output.info["data_type"]).itemsize,
    )
    need = buffers + run.plan.memory_budget
    if need > mem_mb * 2**20:
        raise PlanError(
            f"this job has {mem_mb} MiB (--memory) but a task needs about {need / 2**20:.0f} MiB (plan budget "
            f"{run.plan.memory_budget / 2**20:.0f} MiB + task buffers); raise the job's mem_mb or lower task_chunks"
        )
    return buffers


def _brick(text: Optional[str]) -> Optional[tuple]:
    """``--brick z,y,x`` as three positive ints (None when not given)."""
    if text is None:
        return None
    try:
        brick = tuple(int(v) for v in text.split(","))
    except ValueError:
        brick = ()
    if len(brick) != 3 or min(brick) < 1:
        raise ConfigError(f"--brick {text!r}: give three positive integers z,y,x (the schedule's job box)")
    return brick


@command("validate")
def validate_cmd(
    config: Optional[Path] = typer.Argument(None, help="config.yaml (see docs/configuration.md)"),
    memory: Optional[str] = typer.Option(
        None,
        "--memory",
        "-m",
        help=f"memory of one infer job ({MEMORY_HELP}); the plan's budget is plan.memory_fraction of it",
    ),
    mem_mb: Optional[int] = _deprecated_mem_mb(),
    config_json: Optional[str] = typer.Option(
        None,
        "--config-json",
        help="the config as JSON (used by the workflow so --config overrides count); replaces CONFIG's content",
    ),
    threads: Optional[int] = typer.Option(None, "--threads", help="threads of one infer job (the plan's)"),
    dry_run: bool = typer.Option(False, "--dry-run", help="check and print the plan; write nothing"),
    layer_marker: Optional[Path] = typer.Option(
        None,
        "--layer-marker",
        help="also create the output layer (as `znni create-layer --marker`) and write this marker",
    ),
):
    """Check config, network and layers (everything that can fail before scheduling); write the plan
    (and with --layer-marker create the output layer: the workflow's first job does both)."""
    if config_json is None and config is None:
        fail(ValueError("give CONFIG (config.yaml) or --config-json"), 2)
    cfg = parse_config(json.loads(config_json)) if config_json else load_config(config)
    run, plan = resolve(cfg, mem_mb=memory_mib(memory, mem_mb), threads=threads, progress=_log)
    _log(plan.describe(max_rejected=3))
    changed = check_rerun(previous_identity(run), run, cfg.recompute)  # one_line_errors reports it
    if changed:
        _log(f"recompute: {cfg.recompute}: the tasks another run made are made again for: " + "; ".join(changed[:6]))
    if dry_run:
        _log("dry run: nothing written")
        return
    path = save_run(run, plan)
    _log(f"run file {path}; plan {run.plan.path}; {run.num_tasks} tasks")
    _log_estimate(cfg, run, plan)
    if layer_marker:
        _create_output_layer(path, layer_marker)


@command("estimate")
def estimate_cmd(
    config: Path = typer.Argument(..., help="config.yaml"),
    memory: str = typer.Option(
        "2000MiB", "--memory", "-m", help=f"memory of one infer job ({MEMORY_HELP}; as the profile gives it)"
    ),
    mem_mb: Optional[int] = _deprecated_mem_mb(),
    threads: int = typer.Option(1, "--threads", min=1, help="threads of one infer job"),
    rate: Optional[float] = typer.Option(
        None, "--rate", help="output voxels/s of one job on the target machines (default: measured here)"
    ),
    cores_per_node: Optional[int] = typer.Option(
        None, "--cores-per-node", help="for node-hours (default: this machine's)"
    ),
    as_json: bool = typer.Option(False, "--json", help="print the numbers as JSON"),
):
    """Tasks, jobs, chunks, shards, files, output bytes and node/GPU-hours of a run, before it runs."""
    e = run_estimate(
        load_config(config),
        mem_mb=memory_mib(None if mem_mb is not None else memory, mem_mb),
        threads=threads,
        rate=rate,
        cores_per_node=cores_per_node,
        log=_log,
    )
    typer.echo(json.dumps(e, indent=1) if as_json else describe(e))


@command("create-layer")
def create_layer_cmd(
    run_file: Path = typer.Argument(..., help=RUN_HELP),
    marker: Optional[Path] = typer.Option(None, help="write this local marker file when done"),
):
    """Create the output layer's info and provenance once (or check an existing layer matches)."""
    _create_output_layer(run_file, marker)


@command("tasks")
def tasks_cmd(
    run_file: Path = typer.Argument(..., help=RUN_HELP),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="write the task list as JSON"),
):
    """List the tasks: whole output chunks, disjoint, covering the region."""
    # lazy: loads numba and scipy only when called
    from .task import task_list

    run = load_run(run_file)
    tasks = task_list(run)
    doc = {"run_digest": run.digest, "num_tasks": len(tasks), "tasks": tasks}
    if output:
        atomic_write(output, (json.dumps(doc, indent=1) + "\n").encode())
        _log(f"{len(tasks)} tasks -> {output}")
    else:
        for t in tasks:
            typer.echo(
                f"{t['id']:6d}  write offset {t['write_roi']['offset']} shape {t['write_roi']['shape']}  "
                f"{len(t['chunks'])} chunks"
            )


@command("mask-tasks")
def mask_tasks_cmd(
    run_file: Path = typer.Argument(..., help=RUN_HELP),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="default <work_dir>/mask_tasks.json"),
):
    """With a mask: list the tasks a non-zero mask voxel overlaps (the others are masked, never run)."""
    # lazy: loads numba and scipy only when called
    from .task import open_run

    ctx = open_run(run_file)
    if ctx.mask is None:
        raise ConfigError(f"{run_file}: the run has no mask (config key `mask`)")
    doc = scan(ctx.tasks, ctx.mask, log=_log) | {"run_digest": ctx.run.digest}
    data = (json.dumps(doc, separators=(",", ":")) + "\n").encode()
    path = mask_tasks_path(ctx.run)
    if is_remote_work(path):  # the work directory's copy (the report's), then --output
        atomic_write(path, data)
    path = location(output) if output else path
    atomic_write(path, data)
    _log(
        f"mask: {doc['num_live']:,} of {doc['num_tasks']:,} tasks live ({doc['num_masked']:,} masked), "
        f"{doc['chunks_live']:,} live chunks, {doc['voxels_live']:,} voxels -> {path}"
    )


@command("run-task")
def run_task_cmd(
    run_file: Path = typer.Argument(..., help=RUN_HELP),
    task: Optional[int] = typer.Option(None, "--task", min=0, help="task id (see `znni tasks`)"),
    chunk: Optional[str] = typer.Option(
        None,
        "--chunk",
        help="one chunk: its name x0-x1_y0-y1_z0-z1 or index z,y,x; computed with its task, only this chunk is written",
    ),
    memory: Optional[str] = typer.Option(
        None, "--memory", "-m", help=f"memory of this job ({MEMORY_HELP}); checked against the plan"
    ),
    mem_mb: Optional[int] = _deprecated_mem_mb(),
    progress: bool = typer.Option(True, help="progress bar over patches"),
):
    """Run one task (or rewrite one chunk): read, infer, write whole chunks atomically, verify, manifest."""
    # lazy: loads numba and scipy only when called
    from ..exec.device import claimed_gpu
    from .task import run_task

    if (task is None) == (chunk is None):
        fail(ValueError("give exactly one of --task or --chunk"), 2)
    run = load_run(run_file)
    mem_mb = memory_mib(memory, mem_mb)
    if mem_mb is not None:
        _check_mem(run, mem_mb, run_geometry, task_bytes)
    with claimed_gpu(run.config.device):
        run_task(run_file, task, chunk=chunk, show_progress=progress, log=_log)
    _log("in a workflow: `snakemake ... --forcerun finalize` re-checks every task and refreshes the report")


@command("run-job")
def run_job_cmd(
    run_file: Path = typer.Argument(..., help=RUN_HELP),
    job: int = typer.Option(..., "--job", min=0, help="job number (0, 1, ...)"),
    tasks_per_job: int = typer.Option(..., "--tasks-per-job", min=1, help="tasks per job (the workflow's schedule)"),
    num_tasks: Optional[int] = typer.Option(
        None, "--num-tasks", help="tasks the workflow was scheduled for (checked against the run)"
    ),
    marker: Optional[Path] = typer.Option(None, help="the job's marker (default <work_dir>/jobs/NNNNNN.json)"),
    memory: Optional[str] = typer.Option(
        None, "--memory", "-m", help=f"memory of this job ({MEMORY_HELP}); checked against the plan"
    ),
    mem_mb: Optional[int] = _deprecated_mem_mb(),
    tasks_file: Optional[Path] = typer.Option(
        None,
        "--tasks-file",
        help="with a mask: the live tasks (`znni mask-tasks`; default <work_dir>/mask_tasks.json)",
    ),
    brick: Optional[str] = typer.Option(
        None, "--brick", help="z,y,x: a job is a box of this many tasks (the workflow's schedule)"
    ),
):
    """Run a job: its box or range of tasks, skipping those already done and verified; marker last."""
    # lazy: loads numba and scipy only when called
    from ..exec.device import claimed_gpu

    box = _brick(brick)
    run = load_run(run_file)
    overlap = True  # the next task's input and the last task's output beside the running one
    mem_mb = memory_mib(memory, mem_mb)
    if mem_mb is not None:
        buffers = _check_mem(run, mem_mb, run_geometry, task_bytes)
        overlap = run.plan.memory_budget + 2 * buffers <= mem_mb * 2**20
    with claimed_gpu(run.config.device):  # one job per GPU on a node
        run_job(
            run_file,
            job,
            tasks_per_job,
            num_tasks,
            marker=marker,
            tasks_file=tasks_file,
            log=_log,
            overlap=overlap,
            mem_mb=mem_mb,
            brick=box,
        )


@command("pyramid")
def pyramid_cmd(
    run_file: Path = typer.Argument(..., help=RUN_HELP),
    mip: Optional[int] = typer.Option(None, help="run one job of this mip (with --job)"),
    job: Optional[int] = typer.Option(None, help="the job of --mip to run"),
    tasks_per_job: int = typer.Option(1, help="tasks per job of --mip (the schedule's)"),
    marker: Optional[Path] = typer.Option(None, help="the job's marker (default <work_dir>/pyramid/)"),
):
    """Mips 1..downsample.mips of the output: with --mip/--job one job of one mip; without, build
    what is not done, check every mip's manifests and objects, and write pyramid.json."""
    if (mip is None) != (job is None):
        raise ConfigError("give --mip and --job together (one job of one mip), or neither (the whole pyramid)")
    if mip is not None:
        run_pyramid_job(run_file, mip, job, tasks_per_job, marker=marker, log=_log)
    else:
        build_pyramid(load_run(run_file), log=_log)


@command("finalize")
def finalize_cmd(
    run_file: Path = typer.Argument(..., help=RUN_HELP),
    verify: Optional[str] = typer.Option(None, help="checksum | exists (default from the config)"),
):
    """Check every manifest and chunk, append provenance, write report, preview and viewer link."""
    # lazy: loads numba and scipy only when called
    from .finalize import finalize

    if verify not in (None, "checksum", "exists"):
        raise ConfigError(f"--verify {verify!r}: give checksum or exists")
    s = finalize(run_file, verify=verify, log=_log)
    typer.echo(f"output:      {s['output']}")
    typer.echo(f"report:      {s['preview'].rsplit('/', 1)[0]}/report.html")
    typer.echo(f"preview:     {s['preview']}")
    typer.echo(f"neuroglancer: {s['neuroglancer'][:120]}... (full link in the report)")
    for n in s["viewer_notes"]:
        typer.echo(f"  note: {n}")


@command("demo-data")
def demo_data_cmd(
    out_dir: Path = typer.Argument(Path("demo_out"), help="where to put em/, net.yaml, config.yaml"),
    seed: int = typer.Option(0, help="random seed of the volume"),
):
    """Generate the demo: an EM-like precomputed layer, a small network and a config using them."""
    out_dir = out_dir.resolve()
    r = write_demo(out_dir, seed=seed)
    cfg = write_demo_config(
        out_dir / "config.yaml", out_dir, work_dir=out_dir / "work", output="file://" + str(out_dir / "output")
    )
    _log(f"demo input {r['input']} {r['volume'].shape} uint8; network {r['network']}; config {cfg}")
