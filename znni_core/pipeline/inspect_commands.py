"""The ``znni`` commands that look at a run: status, verify, report, serve.

Each command imports what it runs when it runs: ``znni --help`` and a rule's command start without
loading the engine (numpy, numba, the layers: about a second).
"""

from __future__ import annotations

import time as _time
from pathlib import Path
from typing import Optional

import typer
from typer.core import TyperCommand

from ..errors import ConfigError, ZnniError
from .cli_base import RUN_HELP, _log, command, fail
from .pyramid import pyramid_status
from .report import write_report
from .run import load_run, run_geometry
from .serve import LayerServer, run_layers
from .status import WATCH_EVERY, changed_input_tasks, collect, finished, render, run_file_of
from .status import watch as watch_run
from .verify import verify_run


def _watch_command():
    """``znni status``'s command class: ``--watch`` with an optional value (:mod:`.status`)."""

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
    if not run.config.downsample.mips:
        return []

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
    return changed_input_tasks(run, blocks)


@command("status", cls=_watch_command())
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


@command("verify")
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
    verify_run(run_file, tasks=tasks, samples=samples, seed=seed, checksums=not exists_only, empty=empty, log=_log)
    typer.echo("verify: passed")


@command("report")
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
    try:
        path = write_report(work_dir, snakemake_logs=snakemake_log, log=_log)
    except Exception as exc:  # noqa: BLE001 - a report is best effort: say why, never fail the caller
        _log(f"report: not written ({type(exc).__name__}: {exc})")
        return
    if path is not None:
        typer.echo(f"report:      {path}")


@command("serve")
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
