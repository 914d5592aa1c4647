"""The ``znni`` command line: engine commands here, workflow commands from :mod:`znni_core.pipeline.cli`."""

from __future__ import annotations

import gc
import sys
from enum import Enum
from pathlib import Path
from typing import Optional

import numpy as np
import typer

from . import infer, load_network
from .errors import ZnniError
from .geometry import Coordinate
from .io.volumes import read_volume, write_volume
from .pipeline import cli as pipeline_cli
from .pipeline.cli import MEMORY_HELP, fail
from .pipeline.resolve import net_halo
from .progress import bar
from .units import parse_bytes as parse
from .version import __version__
from .warmup import warmup as run

app = typer.Typer(
    no_args_is_help=True,
    add_completion=False,
    help="znni: exact dense sliding-window inference of 3D ConvNets over EM volumes.",
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"znni {__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="print znni's version and exit"
    ),
) -> None:
    """znni: exact dense sliding-window inference of 3D ConvNets over EM volumes."""


class Device(str, Enum):
    """Where a plan runs (the config's ``device``)."""

    cpu = "cpu"
    gpu = "gpu"
    cpu_gpu = "cpu+gpu"


class Effort(str, Enum):
    """How hard the autotuner searches (the config's ``plan.effort``)."""

    estimate = "estimate"
    measure = "measure"
    exhaustive = "exhaustive"


class Blend(str, Enum):
    """How overlapping patches of a padded network are blended (the config's ``blend.window``)."""

    bump = "bump"
    gaussian = "gaussian"
    linear = "linear"


DEVICE_HELP = (
    "cpu | gpu (GPU-only, or GPU + host RAM when tensors do not fit) | cpu+gpu (first layers on the CPU, pipelined)"
)


def parse_bytes(text: str) -> int:
    """``"2GiB"``, ``"500MB"``, ``"1e9"`` -> bytes."""
    try:
        return parse(text)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None


@app.command()
def info(net: Path = typer.Argument(..., help="network (.onnx or .yaml)")):
    """Describe a network: layers, field of view, halo, digest."""
    try:
        n = load_network(net)
    except ZnniError as exc:
        fail(exc)
    typer.echo(n.describe())
    low, high = n.halo
    typer.echo(f"kind: {n.describe_kind()}")
    typer.echo(
        f"context {n.context}, halo low {low} high {high} (z, y, x); admissible input lengths "
        f"{n.geometry.n_min} + k * {n.grid}"
        + (f"; exported at {n.export_shape}" if n.export_shape else "")
        + f"; digest {n.digest()[:16]}"
    )


@app.command()
def plan(
    net: Path = typer.Argument(..., help="network (.onnx or .yaml)"),
    memory: str = typer.Option(
        None, "--memory", "-m", help=f"memory budget ({MEMORY_HELP}); default: half the available RAM"
    ),
    device: Device = typer.Option(Device.cpu, help=DEVICE_HELP),
    effort: Effort = typer.Option(Effort.estimate, help="how hard to search: estimate (priced), measure, exhaustive"),
    threads: Optional[int] = typer.Option(None, min=1, help="threads (default: the CPUs this process may use)"),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="write the plan as JSON here"),
    rejected: int = typer.Option(5, min=0, help="how many rejected alternatives to print"),
    input_shape: Optional[str] = typer.Option(
        None, "--input-shape", help="Z,Y,X of the input the plan is for: no patch larger than it"
    ),
    patch: Optional[str] = typer.Option(None, "--patch", help="Z,Y,X input patch (graph networks; default: searched)"),
    overlap: Optional[str] = typer.Option(
        None, "--overlap", help="Z,Y,X voxels shared by neighbouring patches (padded graphs)"
    ),
    blend: Blend = typer.Option(Blend.bump, help="window of blended patches (padded graphs)"),
):
    """Autotune and print a plan (ZNNi Table IV style); write it with --output."""
    # lazy: loads numba and scipy only when called
    from .plan import autotune

    try:
        p = autotune(
            load_network(net),
            memory_budget=parse_bytes(memory) if memory else None,
            device=device.value,
            effort=effort.value,
            threads=threads,
            input_shape=_shape3(input_shape, "--input-shape"),
            patch_shape=_shape3(patch, "--patch"),
            overlap=_shape3(overlap, "--overlap"),
            blend=blend.value,
        )
    except ZnniError as exc:
        fail(exc)
    typer.echo(p.describe(max_rejected=rejected))
    if output:
        p.save(output)
        typer.echo(f"\nplan written to {output}")


def _shape3(text: Optional[str], option: str):

    if not text:
        return None
    try:
        shape = tuple(int(v) for v in text.replace("x", ",").split(","))
    except ValueError:
        shape = ()
    if len(shape) != 3:
        raise ZnniError(f"{option} {text!r}: give three integers Z,Y,X (e.g. 15,256,256)")
    return shape


@app.command("infer")
def infer_cmd(
    net: Path = typer.Argument(..., help="network (.onnx or .yaml)"),
    input: str = typer.Argument(
        ...,
        help="input: .npy / .tif, (z, y, x) or (c, z, y, x); or a layer: precomputed "
        "(file://, gs://, s3://, a local directory) or zarr (*.zarr, zarr://...)",
    ),
    output: str = typer.Argument(
        ...,
        help="output: .npy / .tif (float32, (c, z, y, x)); or a new layer "
        "(precomputed or zarr), placed over the input's coordinates",
    ),
    offset: Optional[str] = typer.Option(None, help="region to read: its start Z,Y,X (a layer's absolute voxels)"),
    shape: Optional[str] = typer.Option(None, help="region to read: its size Z,Y,X (default: to the end)"),
    mip: int = typer.Option(0, min=0, help="the input layer's mip"),
    endpoint_url: Optional[str] = typer.Option(None, help="S3-compatible endpoint of s3:// layers"),
    chunk_size: str = typer.Option("64,64,64", "--chunk-size", help="an output layer's chunk size Z,Y,X"),
    memory: str = typer.Option(
        None, "--memory", "-m", help=f"memory budget ({MEMORY_HELP}); default: half the available RAM"
    ),
    plan_path: Optional[Path] = typer.Option(None, "--plan", help="run exactly this plan (from `znni plan`)"),
    scale: Optional[float] = typer.Option(
        None,
        help="multiply the input by this after converting to float32 "
        "(e.g. 0.00392156 for uint8 -> [0, 1]); integer input needs it",
    ),
    shift: Optional[float] = typer.Option(None, help="add this after --scale (x * scale + shift), e.g. -0.5 to centre"),
    device: Device = typer.Option(Device.cpu, help=DEVICE_HELP),
):
    """Dense sliding-window output of NET on an array file or a region of a layer."""
    # lazy: loads numba and scipy only when called
    from .plan import Plan

    try:
        n = load_network(net)
        x, roi, res = read_volume(
            input, offset=_shape3(offset, "--offset"), shape=_shape3(shape, "--shape"), mip=mip, endpoint=endpoint_url
        )
        if scale is not None:
            x = x.astype(np.float32) * np.float32(scale)
        if shift is not None:
            x = x.astype(np.float32) + np.float32(shift)
        p = Plan.load(plan_path) if plan_path else None
        with bar(None, f"znni infer {Path(str(input)).name}", "patch") as progress:
            y = infer(
                n,
                x,
                device=device.value,
                memory_budget=parse_bytes(memory) if memory else None,
                plan=p,
                progress=progress.update,
            )
        at = Coordinate(0, 0, 0) if roi is None else roi.offset
        if y.shape[-3:] != x.shape[-3:]:  # a valid network: output voxel 0 lies at the halo's low end
            at = at + net_halo(n).low
        wrote = write_volume(
            output,
            y,
            offset=tuple(at),
            resolution=res or (1.0, 1.0, 1.0),
            chunk=_shape3(chunk_size, "--chunk-size"),
            endpoint=endpoint_url,
        )
    except (ZnniError, OSError, ValueError) as exc:
        fail(exc)
    typer.echo(f"wrote {wrote}", err=True)


@app.command()
def warmup(
    threads: list[int] = typer.Option(
        [1],
        "--threads",
        help="calibrate for this many threads (repeat for several: --threads 1 --threads 2); "
        "use the threads your jobs run with",
    ),
    no_tune: bool = typer.Option(
        False, "--no-tune", help="keep the vector width recorded (or the default); only compile and calibrate"
    ),
    refine: bool = typer.Option(
        False,
        "--refine",
        help="also measure the vector width (AVX-512 hosts, unless recorded) and tune the kernel "
        "parameters in a full calibration (about a minute on 2 cores)",
    ),
    refresh: bool = typer.Option(False, "--refresh", help="measure the vector width again (implies --refine)"),
):
    """Ready this host for jobs: compile every kernel (two processes) and calibrate quickly, in
    about half a minute; --refine measures the vector width and tunes the kernels.  Everything is
    cached in $ZNNI_CACHE_DIR (shared: every node of a type finds it)."""
    if any(t < 1 for t in threads):
        fail(ValueError(f"--threads {min(threads)}: a thread count is 1 or more"), 2)
    try:
        run(tuple(threads), tune=not no_tune, refresh=refresh, refine=refine, echo=lambda m: typer.echo(m, err=True))
    except (RuntimeError, OSError) as exc:
        fail(exc)


def _register_pipeline() -> None:

    pipeline_cli.register(app)


_register_pipeline()


def main() -> None:  # console-script entry point
    """Run the ``znni`` command line, then freeze the heap so exit skips the last garbage collection."""
    try:
        app()
    finally:
        # the interpreter's last garbage collection walks every object numba's compiler and the
        # engine made: 0.35-0.45 s at the exit of each task job, validate and finalize.  Frozen,
        # they are skipped; files are closed and atexit handlers run as before.
        gc.freeze()


if __name__ == "__main__":
    sys.exit(main())
