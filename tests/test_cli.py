"""The engine CLI: znni info | plan | infer, end to end in subprocess-free typer runs."""
from __future__ import annotations

import numpy as np
from typer.testing import CliRunner

from znni_core.cli import app, parse_bytes
from znni_core.net import save_network
from znni_core.plan import Plan

from .nets import NETS, make_net
from .reference import max_rel_err, torch_dense

runner = CliRunner()


def test_parse_bytes():
    assert parse_bytes("2GiB") == 2 * 2 ** 30
    assert parse_bytes("500MB") == 500 * 10 ** 6
    assert parse_bytes("1e6") == 10 ** 6


def test_info_plan_infer(tmp_path):
    net = make_net(NETS["iso2pool"], seed=3)
    path = save_network(net, tmp_path / "net.yaml")
    r = runner.invoke(app, ["info", str(path)])
    assert r.exit_code == 0 and "field of view" in r.output
    r = runner.invoke(app, ["plan", str(path), "--memory", "64MiB", "--output", str(tmp_path / "plan.json")])
    assert r.exit_code == 0, r.output
    assert "rejected alternatives" in r.output and "primitive" in r.output
    plan = Plan.load(tmp_path / "plan.json")
    assert plan.memory_budget == 64 * 2 ** 20
    vol = np.random.default_rng(0).integers(0, 255, size=(30, 31, 29), dtype=np.uint8)
    np.save(tmp_path / "vol.npy", vol)
    r = runner.invoke(app, ["infer", str(path), str(tmp_path / "vol.npy"), str(tmp_path / "out.npy"),
                            "--plan", str(tmp_path / "plan.json"), "--scale", str(1 / 255)])
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
