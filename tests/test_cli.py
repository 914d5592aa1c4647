"""The engine CLI: znni info | plan | infer, end to end in subprocess-free typer runs."""

from __future__ import annotations

import numpy as np
import pytest
import typer
from typer.testing import CliRunner

from znni_core.cli import app, parse_bytes
from znni_core.net import save_network
from znni_core.plan import Plan

from .nets import NETS, make_net
from .reference import max_rel_err, torch_dense

runner = CliRunner()


def test_parse_bytes():
    assert parse_bytes("2GiB") == 2 * 2**30
    assert parse_bytes("500MB") == 500 * 10**6
    assert parse_bytes("1e6") == 10**6
    for bad, why in (("1e400", "too large"), ("2 GiBs", "not a size"), ("-", "not a size")):
        with pytest.raises(typer.BadParameter, match=why):  # a clear error, never an OverflowError
            parse_bytes(bad)


def test_info_plan_infer(tmp_path):
    net = make_net(NETS["iso2pool"], seed=3)
    path = save_network(net, tmp_path / "net.yaml")
    r = runner.invoke(app, ["info", str(path)])
    assert r.exit_code == 0 and "field of view" in r.output
    r = runner.invoke(app, ["plan", str(path), "--memory", "64MiB", "--output", str(tmp_path / "plan.json")])
    assert r.exit_code == 0, r.output
    assert "rejected alternatives" in r.output and "primitive" in r.output
    plan = Plan.load(tmp_path / "plan.json")
    assert plan.memory_budget == 64 * 2**20
    vol = np.random.default_rng(0).integers(0, 255, size=(30, 31, 29), dtype=np.uint8)
    np.save(tmp_path / "vol.npy", vol)
    r = runner.invoke(
        app,
        [
            "infer",
            str(path),
            str(tmp_path / "vol.npy"),
            str(tmp_path / "out.npy"),
            "--plan",
            str(tmp_path / "plan.json"),
            "--scale",
            str(1 / 255),
        ],
    )
    assert r.exit_code == 0, r.output
    out = np.load(tmp_path / "out.npy")
    ref = torch_dense(net, vol.astype(np.float32) * np.float32(1 / 255))
    assert max_rel_err(out, ref) <= 1e-4


def test_cli_errors_are_clear(tmp_path):
    net = make_net(NETS["iso2pool"], seed=3)
    path = save_network(net, tmp_path / "net.yaml")
    np.save(tmp_path / "vol.npy", np.zeros((30, 30, 30), np.uint8))
    r = runner.invoke(app, ["infer", str(path), str(tmp_path / "vol.npy"), str(tmp_path / "o.npy")])
    assert r.exit_code == 2 and "dtype" in r.output
    r = runner.invoke(app, ["plan", str(path), "--memory", "1kB"])
    assert r.exit_code == 2 and "budget" in r.output


def test_infer_reads_a_layer_region_and_writes_layers_over_it(tmp_path):
    """`znni infer` on a region of a precomputed layer, out to a precomputed and a zarr layer placed
    at the region's offset plus the halo (so it overlays the input), equal to PyTorch on the crop."""
    import zarr

    from znni_core.io import PrecomputedLayer, parse_layer_url
    from znni_core.pipeline.resolve import net_halo

    from .pipeline_helpers import RES, em, write_volume

    net = make_net(NETS["iso2pool"], seed=3)
    path = save_network(net, tmp_path / "net.yaml")
    vol = em((30, 44, 40))
    layer = write_volume(tmp_path / "em", vol)
    off = (2, 5, 3)  # and shape (26, 33, 31)
    crop = vol[2:28, 5:38, 3:34].astype(np.float32) * np.float32(1 / 255) - np.float32(0.5)
    ref = torch_dense(net, crop)
    at = tuple(int(o + h) for o, h in zip(off, net_halo(net).low))
    for out in (tmp_path / "out", tmp_path / "out.zarr"):
        r = runner.invoke(
            app,
            [
                "infer",
                str(path),
                layer,
                str(out),
                "--offset",
                "2,5,3",
                "--shape",
                "26,33,31",
                "--scale",
                str(1 / 255),
                "--shift",
                "-0.5",
                "--chunk-size",
                "8,16,16",
            ],
        )
        assert r.exit_code == 0, r.output
        if out.suffix == ".zarr":
            a = zarr.open_array(str(out / "0"), mode="r")
            got, got_at = np.asarray(a[...]), tuple(a.attrs["voxel_offset"])
            assert tuple(a.attrs["resolution"]) == tuple(RES)
        else:
            lay = PrecomputedLayer(parse_layer_url(str(out)), 0)
            got, got_at = lay.read(lay.bounds)[0], tuple(lay.bounds.offset)
            assert tuple(lay.resolution) == tuple(RES)
        assert got_at == at and max_rel_err(got, ref) <= 1e-4
    r = runner.invoke(
        app,
        [
            "infer",
            str(path),
            layer,
            str(tmp_path / "o.npy"),
            "--offset",
            "2,5,3",
            "--shape",
            "40,33,31",
            "--scale",
            "1",
        ],
    )
    assert r.exit_code == 2 and "not inside" in r.output and "(30, 44, 40)" in r.output


def test_the_console_script_freezes_the_heap_before_exit(monkeypatch):
    """The interpreter's last garbage collection walked every object numba and the engine made
    (a quarter of a second at each task job's exit): ``main`` freezes them, whether the command
    succeeded or failed."""
    import gc
    import sys

    import pytest

    from znni_core import cli

    frozen = []
    monkeypatch.setattr(gc, "freeze", lambda: frozen.append(1))
    for argv, code in ((["znni", "--help"], 0), (["znni", "no-such-command"], 2)):
        monkeypatch.setattr(sys, "argv", argv)
        with pytest.raises(SystemExit) as e:
            cli.main()
        assert e.value.code == code
    assert len(frozen) == 2


def test_progress_bars_show_on_a_terminal_and_stay_out_of_logs():
    """Long commands' bars (``znni_core.progress.bar``): a rate and an ETA on a terminal, nothing
    in a file or a pipe (a job's log)."""
    import io

    from znni_core.progress import bar

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    tty, log = Terminal(), io.StringIO()
    for stream in (tty, log):
        with bar(4, "verify: stored objects", "task", stream=stream) as b:
            b.update(4)
    assert "verify: stored objects" in tty.getvalue() and "/4 [" in tty.getvalue() and "task/s" in tty.getvalue()
    assert log.getvalue() == ""


def test_version_and_license_metadata():
    """``znni --version`` prints the package's version; the installed metadata names the license."""
    from importlib.metadata import metadata

    from znni_core.version import __version__

    r = runner.invoke(app, ["--version"])
    assert r.exit_code == 0 and r.output.strip() == f"znni {__version__}"
    meta = metadata("znni")
    assert meta["Version"] == __version__
    assert meta.get("License-Expression") == "MIT" or meta.get("License") == "MIT", dict(meta)


def _commands():
    """Every ``znni`` command as click sees it: ``{name: click.Command}``."""
    return typer.main.get_command(app).commands


def test_one_flag_name_per_concept():
    """Memory, threads, task, job and chunk are spelt one way in every command (a deprecated
    ``--mem-mb`` is hidden), and no short flag means two things."""
    concept = {
        "memory": {"--memory", "-m"},
        "threads": {"--threads"},
        "task": {"--task"},
        "job": {"--job"},
        "chunk": {"--chunk"},
        "chunk_size": {"--chunk-size"},
    }
    shorts: dict[str, set] = {}
    seen = set()
    for name, cmd in _commands().items():
        for p in cmd.params:
            flags = set(p.opts) | set(p.secondary_opts)
            for f in flags:
                if len(f) == 2:
                    shorts.setdefault(f, set()).add(p.name)
            if p.name in concept and not getattr(p, "hidden", False):
                assert flags == concept[p.name], f"znni {name}: {p.name} is {sorted(flags)}"
                seen.add(p.name)
            if p.name == "mem_mb":
                assert p.hidden, f"znni {name}: --mem-mb is deprecated and hidden"
    assert seen == set(concept)
    assert {f: names for f, names in shorts.items() if len(names) > 1} == {}


def test_choices_are_validated_and_panels_group_the_commands(tmp_path):
    net = make_net(NETS["iso2pool"], seed=3)
    path = save_network(net, tmp_path / "net.yaml")
    for args in (["--device", "tpu"], ["--effort", "fast"], ["--blend", "cosine"]):
        r = runner.invoke(app, ["plan", str(path), *args])
        assert r.exit_code == 2 and "Invalid value" in r.output and args[1] in r.output, r.output
    from znni_core.pipeline.cli import PANELS

    grouped = {n for names in PANELS.values() for n in names}
    assert set(_commands()) == grouped, "every command has its --help panel"
    r = runner.invoke(app, ["--help"])
    assert r.exit_code == 0
    for panel in PANELS:
        assert panel.split(" (")[0] in r.output


def test_memory_takes_sizes_and_names_a_unitless_mistake(tmp_path):
    from znni_core.errors import ConfigError
    from znni_core.pipeline.cli import memory_mib

    assert memory_mib("4GiB") == 4096 and memory_mib("2000MiB") == 2000 and memory_mib(None) is None
    assert memory_mib(None, 300) == 300  # the deprecated --mem-mb
    with pytest.raises(ConfigError, match="less than 1 MiB; give a unit, e.g. 2000MiB"):
        memory_mib("2000")
    with pytest.raises(ConfigError, match="--memory and --mem-mb"):
        memory_mib("1GiB", 300)


@pytest.mark.parametrize("brick", ["1,2", "0,1,1", "a,b,c", "2,2,2,2"])
def test_a_bad_job_box_is_refused_in_one_line(tmp_path, brick):
    """``run-job --brick`` takes three positive integers; anything else exits 2 naming the value,
    before the run file is even read."""
    r = runner.invoke(
        app, ["run-job", str(tmp_path / "run.json"), "--job", "0", "--tasks-per-job", "1", "--brick", brick]
    )
    assert r.exit_code == 2 and f"--brick {brick!r}" in r.output and "three positive integers" in r.output, r.output
    assert "Traceback" not in r.output
