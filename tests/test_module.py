"""znni imported as a Snakemake module by a parent workflow.

The parent defines its own `rule all` (no `default_target`), its own `shell.prefix`, imports znni
with `prefix:` and a relative `work_dir`, and consumes znni's report. Checked: the parent's target
ran (znni took no default target), the parent's rules kept their prefix and received none of znni's
environment, znni's files are where Snakemake expects them (under the prefix), and the output
equals a plain znni run of the same config.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from .pipeline_helpers import base_config, em, layer_files, subprocess_env, write_volume

REPO = Path(__file__).resolve().parents[1]

PARENT = """\
{prefix_before}
rule all:
    input:
        "consumed.json",

module znni:
    snakefile:
        {snakefile!r}
    config:
        config["znni"]
{prefix}
use rule * from znni as znni_*
{prefix_after}
rule consume:
    input:
        rules.znni_finalize.output.summary,
    output:
        "consumed.json",
    shell:
        "env | grep -E '^(NUMBA_|GOMP_|KMP_|ZNNI_VECTOR)' > numba_env.txt || true; cp {{input}} {{output}}"
"""
SHELL_PREFIX = 'shell.prefix("echo parent-prefix >> prefix.log; ")\n'


def _parent(tmp_path: Path, work_dir: str, prefix: str | None, mask: bool = False, shell_prefix: str = "before"):
    """Run a parent workflow importing znni (``prefix``: the module's ``prefix:``), its own
    ``shell.prefix`` set ``before`` or ``after`` the import."""
    cfg = base_config(tmp_path / "data", vol=em((10, 34, 34)))
    cfg["work_dir"] = work_dir
    if mask:  # the mask's checkpoint inside a module (its rule renamed znni_mask_tasks)
        m = np.zeros((10, 34, 34), np.uint8)
        m[:, :12, :12] = 1
        cfg["mask"] = {"path": write_volume(tmp_path / "mask", m)}
    (tmp_path / "parent.yaml").write_text(yaml.safe_dump({"znni": cfg}))
    (tmp_path / "Snakefile").write_text(
        PARENT.format(
            snakefile=str(REPO / "workflow" / "Snakefile"),
            prefix=f"    prefix:\n        {prefix!r}\n" if prefix else "",
            prefix_before=SHELL_PREFIX if shell_prefix == "before" else "",
            prefix_after=SHELL_PREFIX if shell_prefix == "after" else "",
        )
    )
    env = subprocess_env()
    # what leaks must come from znni (this test process's own imports set GOMP_SPINCOUNT, KMP_...)
    env = {k: v for k, v in env.items() if not k.startswith(("NUMBA_", "KMP_")) and k != "GOMP_SPINCOUNT"}
    p = subprocess.run(
        [sys.executable, "-m", "snakemake", "--cores", "2", "--configfile", "parent.yaml"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, (p.stdout + p.stderr)[-5000:]
    return cfg, p


def _check(tmp_path: Path, cfg: dict, work: Path, p):
    summary = json.loads((tmp_path / "consumed.json").read_text())
    assert summary == json.loads((work / "report" / "summary.json").read_text())
    assert summary["failed"] == [] and summary["done"] + summary.get("tasks_masked", 0) == summary["tasks"] > 1
    if "mask" in cfg:
        assert 0 < summary["tasks_masked"] < summary["tasks"]
    # znni's numba and OpenMP settings stay in znni's rules, wherever the parent sets its shell.prefix
    # (Snakemake's own OMP_NUM_THREADS & co. for the rule's threads are not znni's)
    assert (tmp_path / "numba_env.txt").read_text() == ""
    assert "parent-prefix" in (tmp_path / "prefix.log").read_text()  # the parent's prefix still applies
    assert (work / "run.json").is_file() and (work / "schedule.json").is_file()
    assert "(Rule: consume)" in p.stdout + p.stderr
    # the same bytes as a plain znni run of this config
    plain = dict(cfg, work_dir=str(tmp_path / "plain_work"), output=dict(cfg["output"], path=str(tmp_path / "plain")))
    (tmp_path / "plain.yaml").write_text(yaml.safe_dump(plain))
    q = subprocess.run(
        [
            sys.executable,
            "-m",
            "snakemake",
            "-s",
            str(REPO / "workflow" / "Snakefile"),
            "--profile",
            str(REPO / "profiles" / "local"),
            "--configfile",
            "plain.yaml",
        ],
        cwd=tmp_path,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert q.returncode == 0, q.stderr[-3000:]
    assert layer_files(plain["output"]["path"]) == layer_files(cfg["output"]["path"])


def test_parent_imports_znni_with_prefix_and_relative_work_dir(tmp_path):
    cfg, p = _parent(tmp_path, "work", prefix="znni_run")
    assert not (tmp_path / "work").exists()  # the prefix holds znni's work directory
    _check(tmp_path, cfg, tmp_path / "znni_run" / "work", p)


@pytest.mark.slow  # ~60 s
def test_parent_imports_znni_without_prefix_absolute_work_dir_with_a_mask(tmp_path):
    cfg, p = _parent(tmp_path, str(tmp_path / "abs_work"), prefix=None, mask=True, shell_prefix="after")
    _check(tmp_path, cfg, tmp_path / "abs_work", p)


# The parent records every key set or deleted in os.environ while znni's workflow is parsed, and
# the environment before and after the import, as this process has it and as a child inherits it.
ENV_PARENT = """\
import json, os, subprocess

TOUCHED = []
_Environ = type(os.environ)
_set, _del = _Environ.__setitem__, _Environ.__delitem__
_Environ.__setitem__ = lambda self, k, v: (TOUCHED.append(k), _set(self, k, v))[1]
_Environ.__delitem__ = lambda self, k: (TOUCHED.append(k), _del(self, k))[1]


def dump(name):
    child = subprocess.run(["env", "-0"], capture_output=True, check=True).stdout.decode()
    inherited = dict(e.split("=", 1) for e in child.split("\\0") if e)
    with open(name, "w") as f:
        json.dump({{"environ": dict(os.environ), "inherited": inherited, "touched": TOUCHED}}, f)

{prefix_before}
rule all:
    input:
        "consumed.json",

dump("env_before.json")
module znni:
    snakefile:
        {snakefile!r}
    config:
        config["znni"]
use rule * from znni as znni_*
dump("env_after.json")
{prefix_after}
rule consume:
    input:
        rules.znni_finalize.output.summary,
    output:
        "consumed.json",
    shell:
        "cp {{input}} {{output}}"
"""
ZNNI_COMMAND = re.compile(r"\bznni (validate|mask-tasks|run-job|pyramid|finalize)\b")
ASSIGNMENTS = re.compile(r"(?:\b[A-Za-z_][A-Za-z0-9_]*=\S*\s+)*$")


@pytest.mark.parametrize("shell_prefix", ["none", "before", "after"])
def test_parsing_znni_as_a_module_leaves_the_environment_and_its_jobs_set_their_own(tmp_path, shell_prefix):
    """Parsing znni's workflow inside a parent (with the parent's ``shell.prefix`` set before the
    import, after it, or not at all) leaves ``os.environ`` exactly as it found it, though znni's
    imports and schedule set variables in that process; each of znni's commands sets what its
    job needs itself (``{params.env}``): a dry run's ``--printshellcmds``."""
    cfg = base_config(tmp_path / "data", vol=em((8, 24, 24)))
    cfg["work_dir"] = "work"
    (tmp_path / "parent.yaml").write_text(yaml.safe_dump({"znni": cfg}))
    (tmp_path / "Snakefile").write_text(
        ENV_PARENT.format(
            snakefile=str(REPO / "workflow" / "Snakefile"),
            prefix_before=SHELL_PREFIX if shell_prefix == "before" else "",
            prefix_after=SHELL_PREFIX if shell_prefix == "after" else "",
        )
    )
    env = {k: v for k, v in subprocess_env().items() if not k.startswith(("NUMBA_", "KMP_", "GOMP_"))}
    p = subprocess.run(
        [sys.executable, "-m", "snakemake", "-n", "--printshellcmds", "--cores", "2", "--configfile", "parent.yaml"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-5000:]
    before, after = (json.loads((tmp_path / f"env_{w}.json").read_text()) for w in ("before", "after"))
    # not a vacuous check: the parse did set variables here (joblib's KMP_INIT_AT_FORK, ...)
    assert set(after["touched"]) - set(before["touched"]), "parsing znni set nothing: this test checks nothing"
    for view in ("environ", "inherited"):  # os.environ, and what a process the parent starts sees (putenv)
        a, b = before[view], after[view]
        assert a == b, {k: (a.get(k), b.get(k)) for k in set(a) | set(b) if a.get(k) != b.get(k)}

    commands = {}
    for line in out.splitlines():
        m = ZNNI_COMMAND.search(line)
        if m:  # the assignments just before `znni` (after the parent's prefix, if Snakemake shows it)
            commands.setdefault(m.group(1), ASSIGNMENTS.search(line[: m.start()]).group(0).strip())
    assert {"validate", "run-job", "finalize"} <= set(commands), out[-3000:]
    clean = {"PATH": env["PATH"], "HOME": str(tmp_path / "home")}
    for sub, assignments in commands.items():
        q = subprocess.run(["bash", "-c", f"{assignments} env -0"], env=clean, capture_output=True, text=True)
        job = dict(e.split("=", 1) for e in q.stdout.split("\0") if e)
        assert job.get("NUMBA_THREADING_LAYER") == "threadsafe", (sub, assignments)
        assert job.get("NUMBA_CACHE_DIR") == str(tmp_path / "home" / ".cache" / "znni" / "numba"), (sub, assignments)
        assert job.get("PYTHONDONTWRITEBYTECODE") == "", (sub, assignments)
