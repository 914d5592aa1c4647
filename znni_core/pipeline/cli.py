"""Workflow commands of the ``znni`` CLI (validate, create-layer, tasks, run-job, run-task, finalize, status,
report, demo-data, serve).  Each Snakemake rule calls exactly one of them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

RUN_HELP = "the run file <work_dir>/run.json written by `znni validate` (or the config.yaml, mapped to it)"


def fail(exc: Exception, code: int | None = None):
    """Print ``error: <message>`` (no traceback) and exit: ``code``, else the error's
    ``exit_code`` (2: a wrong input or request; 1: a failure while running)."""
    typer.echo(f"error: {exc}", err=True)
    raise typer.Exit(code if code is not None else getattr(exc, "exit_code", 1))


def _log(msg: str) -> None:
    typer.echo(msg, err=True)


def _argument_file(kwargs: dict):
    """The file argument a command was given (its run file or config), for a message."""
    return next((kwargs[k] for k in ("run_file", "config") if kwargs.get(k) is not None), None)


def one_line_errors(command):
    """``command`` with every error that escapes it printed as one line (:func:`fail`), never a
    traceback: a :class:`~znni_core.errors.ZnniError` as it is; an OS error (a directory where a
    file is expected, a path that cannot be read or written) or text that is not UTF-8 as a
    :class:`~znni_core.errors.ConfigError` (the path is wrong: exit 2) or a
    :class:`~znni_core.errors.DataError` (the storage failed: exit 1) naming the file."""
    import functools

    @functools.wraps(command)
    def run(*args, **kwargs):
        from ..errors import ConfigError, DataError, ZnniError

        try:
            return command(*args, **kwargs)
        except ZnniError as exc:
            fail(exc)
        except UnicodeDecodeError as exc:
            fail(
                ConfigError(f"{_argument_file(kwargs) or 'a file'}: not UTF-8 text ({exc.reason} at byte {exc.start})")
            )
        except OSError as exc:
            path = exc.filename2 if exc.filename2 is not None else exc.filename
            what = f"{path}: " if path is not None else ""
            if isinstance(exc, (IsADirectoryError, NotADirectoryError, FileNotFoundError, FileExistsError)):
                kind = "a directory" if isinstance(exc, IsADirectoryError) else None
                fail(
                    ConfigError(
                        f"{what}{exc.strerror or exc}"
                        + (f" ({kind} where a file is expected)" if kind else "")
                        + "; check the path given"
                    )
                )
            fail(DataError(f"{what}{exc.strerror or exc}; fix the storage (permissions, disk) and re-run"))

    return run


# `znni --help` groups the commands: what a user types, and the steps the workflow's rules run
# (still callable: re-running one task by hand is `run-task`, a user command).
PANELS = {
    "Inference": ("info", "plan", "infer", "warmup"),
    "Runs": ("demo-data", "validate", "estimate", "status", "run-task", "verify", "report", "serve"),
    "Workflow steps (run by the Snakemake rules)": (
        "create-layer",
        "tasks",
        "mask-tasks",
        "run-job",
        "pyramid",
        "finalize",
    ),
}


def help_panel(name: str) -> str:
    """The ``--help`` panel of command ``name``."""
    return next((panel for panel, names in PANELS.items() if name in names), "Runs")


MEMORY_HELP = "e.g. 4GiB or 4000MiB (a bare number is bytes)"


def memory_mib(text: Optional[str], mem_mb: Optional[int] = None, option: str = "--memory") -> Optional[int]:
    """``--memory`` (a size: ``4GiB``, ``4000MiB``) in MiB, the unit of Snakemake's ``mem_mb``;
    ``mem_mb`` is the deprecated ``--mem-mb`` (MiB), accepted with a warning."""
    from ..errors import ConfigError
    from ..units import parse_bytes

    if mem_mb is not None:
        if text is not None:
            raise ConfigError(f"{option} and --mem-mb given: give {option} only (--mem-mb is deprecated)")
        _log(f"warning: --mem-mb is deprecated; use {option} {mem_mb}MiB")
        return mem_mb
    if text is None:
        return None
    try:
        b = parse_bytes(text)
    except ValueError as exc:
        raise ConfigError(f"{option} {text}: {exc}") from None
    if b < 2**20:
        raise ConfigError(f"{option} {text}: {b} bytes is less than 1 MiB; give a unit, e.g. {text}MiB")
    return b // 2**20


def _deprecated_mem_mb():
    return typer.Option(None, "--mem-mb", hidden=True, help="deprecated: --memory NMiB")


def register(app: typer.Typer) -> None:
    """Add the workflow commands to the main ``znni`` app, each under :func:`one_line_errors`,
    each in its ``--help`` panel."""
    first = len(app.registered_commands)
    _register(app)
    for info in app.registered_commands[first:]:
        info.callback = one_line_errors(info.callback)
    for info in app.registered_commands:
        info.rich_help_panel = help_panel(info.name or info.callback.__name__)


def _register(app: typer.Typer) -> None:
    @app.command("validate")
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
        from ..errors import ZnniError
        from .identity import check_rerun, previous_identity
        from .resolve import resolve
        from .run import save_run
        from .settings import load_config, parse_config

        try:
            if config_json is None and config is None:
                fail(ValueError("give CONFIG (config.yaml) or --config-json"), 2)
            cfg = parse_config(json.loads(config_json)) if config_json else load_config(config)
            run, plan = resolve(cfg, mem_mb=memory_mib(memory, mem_mb), threads=threads, progress=_log)
        except ZnniError as exc:
            fail(exc)
        _log(plan.describe(max_rejected=3))
        changed = check_rerun(previous_identity(run.work_dir), run, cfg.recompute)  # one_line_errors reports it
        if changed:
            _log(
                f"recompute: {cfg.recompute}: the tasks another run made are made again for: " + "; ".join(changed[:6])
            )
        if dry_run:
            _log("dry run: nothing written")
            return
        path = save_run(run, plan, Path(run.work_dir))
        _log(f"run file {path}; plan {run.plan.path}; {run.num_tasks} tasks")
        _log_estimate(cfg, run, plan)
        if layer_marker:
            _create_output_layer(path, layer_marker)

    @app.command("estimate")
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
        from ..errors import ZnniError
        from .estimate import describe, run_estimate
        from .settings import load_config

        try:
            e = run_estimate(
                load_config(config),
                mem_mb=memory_mib(None if mem_mb is not None else memory, mem_mb),
                threads=threads,
                rate=rate,
                cores_per_node=cores_per_node,
                log=_log,
            )
        except ZnniError as exc:
            fail(exc)
        typer.echo(json.dumps(e, indent=1) if as_json else describe(e))

    @app.command("create-layer")
    def create_layer_cmd(
        run_file: Path = typer.Argument(..., help=RUN_HELP),
        marker: Optional[Path] = typer.Option(None, help="write this local marker file when done"),
    ):
        """Create the output layer's info and provenance once (or check an existing layer matches)."""
        _create_output_layer(run_file, marker)

    @app.command("tasks")
    def tasks_cmd(
        run_file: Path = typer.Argument(..., help=RUN_HELP),
        output: Optional[Path] = typer.Option(None, "--output", "-o", help="write the task list as JSON"),
    ):
        """List the tasks: whole output chunks, disjoint, covering the region."""
        from ..errors import ZnniError
        from ..io import atomic_write
        from .run import load_run
        from .task import task_list

        try:
            run = load_run(run_file)
            tasks = task_list(run)
        except ZnniError as exc:
            fail(exc)
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

    @app.command("mask-tasks")
    def mask_tasks_cmd(
        run_file: Path = typer.Argument(..., help=RUN_HELP),
        output: Optional[Path] = typer.Option(None, "--output", "-o", help="default <work_dir>/mask_tasks.json"),
    ):
        """With a mask: list the tasks a non-zero mask voxel overlaps (the others are masked, never run)."""
        from ..errors import ConfigError, ZnniError
        from ..io import atomic_write
        from .mask import mask_tasks_path, scan
        from .task import open_run

        try:
            ctx = open_run(run_file)
            if ctx.mask is None:
                raise ConfigError(f"{run_file}: the run has no mask (config key `mask`)")
            doc = scan(ctx.tasks, ctx.mask, log=_log) | {"run_digest": ctx.run.digest}
        except ZnniError as exc:
            fail(exc)
        path = output or mask_tasks_path(ctx.run)
        atomic_write(path, (json.dumps(doc, separators=(",", ":")) + "\n").encode())
        _log(
            f"mask: {doc['num_live']:,} of {doc['num_tasks']:,} tasks live ({doc['num_masked']:,} masked), "
            f"{doc['chunks_live']:,} live chunks, {doc['voxels_live']:,} voxels -> {path}"
        )

    @app.command("run-task")
    def run_task_cmd(
        run_file: Path = typer.Argument(..., help=RUN_HELP),
        task: Optional[int] = typer.Option(None, "--task", min=0, help="task id (see `znni tasks`)"),
        chunk: Optional[str] = typer.Option(
            None,
            "--chunk",
            help="one chunk: its name x0-x1_y0-y1_z0-z1 or "
            "index z,y,x; computed with its task, only this chunk is written",
        ),
        memory: Optional[str] = typer.Option(
            None, "--memory", "-m", help=f"memory of this job ({MEMORY_HELP}); checked against the plan"
        ),
        mem_mb: Optional[int] = _deprecated_mem_mb(),
        progress: bool = typer.Option(True, help="progress bar over patches"),
    ):
        """Run one task (or rewrite one chunk): read, infer, write whole chunks atomically, verify, manifest."""
        from ..errors import ZnniError
        from ..exec.device import claimed_gpu
        from .resolve import task_bytes
        from .run import load_run, run_geometry
        from .task import run_task

        if (task is None) == (chunk is None):
            fail(ValueError("give exactly one of --task or --chunk"), 2)
        try:
            run = load_run(run_file)
            mem_mb = memory_mib(memory, mem_mb)
            if mem_mb is not None:
                _check_mem(run, mem_mb, run_geometry, task_bytes)
            with claimed_gpu(run.config.device):
                run_task(run_file, task, chunk=chunk, show_progress=progress, log=_log)
        except ZnniError as exc:
            fail(exc)
        _log("in a workflow: `snakemake ... --forcerun finalize` re-checks every task and refreshes the report")

    @app.command("run-job")
    def run_job_cmd(
        run_file: Path = typer.Argument(..., help=RUN_HELP),
        job: int = typer.Option(..., "--job", min=0, help="job number (0, 1, ...)"),
        tasks_per_job: int = typer.Option(
            ..., "--tasks-per-job", min=1, help="tasks per job (the workflow's schedule)"
        ),
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
        from ..errors import ZnniError
        from ..exec.device import claimed_gpu
        from .jobs import run_job
        from .resolve import task_bytes
        from .run import load_run, run_geometry

        try:
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
        except ZnniError as exc:
            fail(exc)

    @app.command("finalize")
    def finalize_cmd(
        run_file: Path = typer.Argument(..., help=RUN_HELP),
        verify: Optional[str] = typer.Option(None, help="checksum | exists (default from the config)"),
    ):
        """Check every manifest and chunk, append provenance, write report, preview and viewer link."""
        from ..errors import ConfigError, ZnniError
        from .finalize import finalize

        try:
            if verify not in (None, "checksum", "exists"):
                raise ConfigError(f"--verify {verify!r}: give checksum or exists")
            s = finalize(run_file, verify=verify, log=_log)
        except ZnniError as exc:
            fail(exc)
        typer.echo(f"output:      {s['output']}")
        typer.echo(f"report:      {Path(s['preview']).with_name('report.html')}")
        typer.echo(f"preview:     {s['preview']}")
        typer.echo(f"neuroglancer: {s['neuroglancer'][:120]}... (full link in the report)")
        for n in s["viewer_notes"]:
            typer.echo(f"  note: {n}")

    @app.command("verify")
    def verify_cmd(
        run_file: Path = typer.Argument(..., help=RUN_HELP),
        tasks: int = typer.Option(8, min=0, help="tasks whose voxels are recomputed (chain networks)"),
        samples: int = typer.Option(64, min=0, help="random voxels recomputed per task (its corners too)"),
        seed: int = typer.Option(0, min=0, help="the sample's seed (recorded in verify.json)"),
        exists_only: bool = typer.Option(False, "--exists-only", help="stored objects: existence, not checksums"),
        empty: int = typer.Option(
            64, min=0, help="chunks recorded empty checked: input context all 0 (edge policy applied), nothing stored"
        ),
    ):
        """Check a finished run: every stored object against its manifest, and a sample of voxels
        recomputed from the network's definition; writes <work_dir>/verify.json."""
        from ..errors import ZnniError
        from .verify import verify_run

        try:
            verify_run(
                run_file, tasks=tasks, samples=samples, seed=seed, checksums=not exists_only, empty=empty, log=_log
            )
        except ZnniError as exc:
            fail(exc)
        typer.echo("verify: passed")

    @app.command("pyramid")
    def pyramid_cmd(
        run_file: Path = typer.Argument(..., help=RUN_HELP),
        mip: Optional[int] = typer.Option(None, help="run one job of this mip (with --job)"),
        job: Optional[int] = typer.Option(None, help="the job of --mip to run"),
        tasks_per_job: int = typer.Option(1, help="tasks per job of --mip (the schedule's)"),
        marker: Optional[Path] = typer.Option(None, help="the job's marker (default <work_dir>/pyramid/)"),
    ):
        """Mips 1..downsample.mips of the output: with --mip/--job one job of one mip; without, build
        what is not done, check every mip's manifests and objects, and write pyramid.json."""
        from ..errors import ConfigError, ZnniError
        from .pyramid import build_pyramid, run_pyramid_job
        from .run import load_run

        try:
            if (mip is None) != (job is None):
                raise ConfigError("give --mip and --job together (one job of one mip), or neither (the whole pyramid)")
            if mip is not None:
                run_pyramid_job(run_file, mip, job, tasks_per_job, marker=marker, log=_log)
            else:
                build_pyramid(load_run(run_file), log=_log)
        except ZnniError as exc:
            fail(exc)

    @app.command("status", cls=_watch_command())
    def status_cmd(
        run_file: Path = typer.Argument(
            ..., metavar="WORK_DIR", help="the work directory (or its run.json, or the config.yaml)"
        ),
        check_inputs: bool = typer.Option(
            False,
            "--check-inputs",
            help="also list the done tasks whose input objects changed in place since they ran "
            "(one stat or HEAD request per input object of every done task); exit 1 if any",
        ),
        watch: Optional[float] = typer.Option(
            None,
            "--watch",
            metavar="[SECONDS]",
            help="redraw every SECONDS (default 10) until every task is done or failed (then exit 1 if any "
            "failed); Ctrl-C stops (exit 0)",
        ),
        max_iterations: Optional[int] = typer.Option(None, "--max-iterations", hidden=True, min=1),
    ):
        """Tasks done, running, failed, masked and not started; throughput, ETA and the slowest jobs
        (from the manifests and the jobs' records; nothing stored is read)."""
        import time as _time

        from ..errors import ZnniError
        from .run import load_run, run_geometry
        from .status import changed_input_tasks, collect, finished, render, run_file_of
        from .status import watch as watch_run

        try:
            run = load_run(run_file_of(run_file))
            if watch is not None:
                try:
                    s = watch_run(
                        run,
                        max(watch, 0.1),
                        typer.echo,
                        max_iterations=max_iterations,
                        extra=lambda _: "\n".join(_pyramid_lines(run)),
                    )
                except KeyboardInterrupt:
                    raise typer.Exit(0) from None
                if finished(s) and s["failed"]:
                    raise typer.Exit(1)
                return
            _, _, _, blocks = run_geometry(run)
            state = collect(run, now=_time.time())
        except ZnniError as exc:
            fail(exc)
        typer.echo(render(state))
        for line in _pyramid_lines(run):
            typer.echo(line)
        if check_inputs:
            done = set(state["done"])
            stale = changed_input_tasks(run, [b for b in blocks if b.id in done])
            for task, changed in stale:
                typer.echo(f"task {task}: {len(changed)} input object(s) changed since it ran: {changed[0]}")
            typer.echo(
                f"{len(stale)} done task(s) read input objects that changed since"
                + ("; recompute them with recompute: inputs (snakemake ... --config recompute=inputs)" if stale else "")
            )
            if stale:
                raise typer.Exit(1)

    @app.command("report")
    def report_cmd(
        work_dir: Path = typer.Argument(
            ..., metavar="WORK_DIR", help="the work directory (or its run.json, or the config.yaml)"
        ),
        snakemake_log: list[Path] = typer.Option(
            [], "--snakemake-log", help="Snakemake's log of the run: its failed jobs are recorded (repeatable)"
        ),
    ):
        """Write <work_dir>/report/report.html from whatever is on disk (a failed or partial run
        too): what failed, why and where its log is; retries, OOMs, timeouts; cost; previews; the
        config.  Never fails on a partial run (the workflow's onerror runs it)."""
        from .report import write_report

        try:
            path = write_report(work_dir, snakemake_logs=snakemake_log, log=_log)
        except Exception as exc:  # noqa: BLE001 - a report is best effort: say why, never fail the caller
            _log(f"report: not written ({type(exc).__name__}: {exc})")
            return
        if path is not None:
            typer.echo(f"report:      {path}")

    @app.command("demo-data")
    def demo_data_cmd(
        out_dir: Path = typer.Argument(Path("demo_out"), help="where to put em/, net.yaml, config.yaml"),
        seed: int = typer.Option(0, help="random seed of the volume"),
    ):
        """Generate the demo: an EM-like precomputed layer, a small network and a config using them."""
        from .demo import write_demo, write_demo_config

        out_dir = out_dir.resolve()
        r = write_demo(out_dir, seed=seed)
        cfg = write_demo_config(
            out_dir / "config.yaml", out_dir, work_dir=out_dir / "work", output="file://" + str(out_dir / "output")
        )
        _log(f"demo input {r['input']} {r['volume'].shape} uint8; network {r['network']}; config {cfg}")

    @app.command("serve")
    def serve_cmd(
        run_file: Optional[Path] = typer.Argument(
            None, help="the run: config.yaml, run.json or its work dir (serves its file:// input and output)"
        ),
        layer: list[str] = typer.Option(
            [], help="serve a layer directory: NAME=PATH or PATH (name: its basename); repeatable"
        ),
        port: int = typer.Option(1337, help="port (0: any free one)"),
        host: str = typer.Option(
            "127.0.0.1", help="address to bind; other than loopback exposes the layers to the network"
        ),
        allow_origin: list[str] = typer.Option(
            [],
            help="also grant CORS to this origin (a remote Neuroglancer, e.g. https://neuroglancer-demo.appspot.com)",
        ),
    ):
        """Serve a run's layers and the bundled Neuroglancer client over HTTP (nothing else)."""
        from ..errors import ConfigError, ZnniError
        from .run import load_run
        from .serve import LayerServer, run_layers

        try:
            layers = {}
            if run_file is not None:
                if run_file.is_dir():
                    run_file = run_file / "run.json"
                    if not run_file.is_file():
                        raise ConfigError(
                            f"{run_file} does not exist: znni serve takes a run (config.yaml, run.json "
                            "or its work dir) or --layer PATH, never a whole directory tree"
                        )
                layers.update(run_layers(load_run(run_file)))
            for spec in layer:
                name, _, path = spec.partition("=") if "=" in spec else (Path(spec).name, "", spec)
                layers[name] = Path(path)
            if not layers:
                raise ConfigError(
                    "nothing to serve: give a run (config.yaml, run.json or its work dir) with file:// "
                    "layers, or --layer PATH"
                )
            srv = LayerServer(layers, host=host, port=port, allow_origins=allow_origin, log=_log)
        except (ZnniError, OSError) as exc:
            fail(exc)
        for name, d in srv.layers.items():
            _log(f"layer {name}: {d} -> {srv.url}/layers/{name}")
        _log(f"viewer: {srv.url}/" if srv.viewer else "viewer: not installed (pip install neuroglancer); layers only")
        _log(f"serving on {srv.url} (Ctrl-C to stop)")
        try:
            srv.serve_forever()
        except KeyboardInterrupt:
            pass
        finally:
            srv.close()


def _watch_command():
    """``znni status``'s command class: ``--watch`` with an optional value (:mod:`.status`)."""
    from typer.core import TyperCommand

    from .status import WATCH_EVERY

    class WatchCommand(TyperCommand):
        def parse_args(self, ctx, args):
            args = list(args)
            for i, a in enumerate(args):
                if a == "--":
                    break
                if a == "--watch":  # without a number after it: the default interval
                    try:
                        float(args[i + 1])
                    except (IndexError, ValueError):
                        args.insert(i + 1, str(WATCH_EVERY))
                    break
            return super().parse_args(ctx, args)

    return WatchCommand


def _pyramid_lines(run) -> list[str]:
    """``znni status``'s lines of the pyramid (from the manifests: stale tasks, mip 0 re-run under
    them, are not done)."""
    from ..errors import ZnniError

    if not run.config.downsample.mips:
        return []
    from .pyramid import pyramid_status

    try:
        return [
            f"pyramid mip {s['mip']}: {s['tasks'] - len(s['not_done'])} of {s['tasks']} tasks done; "
            f"not done or stale: {sorted(s['not_done'])[:50]}" + (" ..." if len(s["not_done"]) > 50 else "")
            for s in pyramid_status(run)
        ]
    except ZnniError as exc:
        return [f"pyramid: unknown ({exc})"]


def _changed_input_tasks(run, blocks) -> list:
    """:func:`.status.changed_input_tasks` (what ``znni status --check-inputs`` lists)."""
    from .status import changed_input_tasks

    return changed_input_tasks(run, blocks)


def _create_output_layer(run_file: Path, marker: Optional[Path]) -> None:
    """The output layer's info and provenance, once (an existing layer must match), then ``marker``."""
    from ..errors import ZnniError
    from ..io import atomic_write, create_layer, parse_layer_url
    from .finalize import output_mapping
    from .run import load_run, output_specs

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
    from ..errors import ZnniError
    from .estimate import describe, estimate
    from .schedule import compute_schedule

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
    import numpy as np

    from ..errors import PlanError

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
    from ..errors import ConfigError

    if text is None:
        return None
    try:
        brick = tuple(int(v) for v in text.split(","))
    except ValueError:
        brick = ()
    if len(brick) != 3 or min(brick) < 1:
        raise ConfigError(f"--brick {text!r}: give three positive integers z,y,x (the schedule's job box)")
    return brick
