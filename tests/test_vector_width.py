"""The vector width numba compiles for (``layers/vector_width.py``) and ``znni warmup``.

Which width a process compiles for follows a fixed precedence (the user's numba settings, then
``ZNNI_VECTOR_WIDTH``, then the host's measured choice, then the default); every width computes
the same results (the kernels compiled for 256-bit vectors and for an AVX2-only Haswell, each in
a process of its own, against float64 references); ``znni warmup`` records the faster width and
leaves a cache in which a new process compiles nothing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

from znni_core.layers import tuning
from znni_core.layers import vector_width as vw

ROOT = Path(__file__).resolve().parent.parent
AVX512 = "+avx512f" in vw.host_features().split(",")
#: AVX2 without AVX-512, as a Zen 3 has it (``benchmarks/isa.py``'s avx2 build)
ZEN3 = "+64bit,+avx,+avx2,+bmi,+bmi2,+f16c,+fma,+popcnt,+sse4.2,-avx512f"
SKX = "+64bit,+avx,+avx2,+avx512bw,+avx512cd,+avx512dq,+avx512f,+avx512vl,+bmi,+bmi2,+f16c,+fma,+popcnt,+sse4.2"


@pytest.fixture
def host(monkeypatch, tmp_path):
    """An isolated cache and a host with (``host(True)``) or without AVX-512 features."""
    monkeypatch.setenv("ZNNI_CACHE_DIR", str(tmp_path))
    for k in ("NUMBA_CPU_NAME", "NUMBA_CPU_FEATURES", "ZNNI_VECTOR_WIDTH"):
        monkeypatch.delenv(k, raising=False)

    monkeypatch.setattr(vw, "APPLIED", vw.APPLIED)  # apply() in a test must not change this process's key

    def make(avx512: bool):
        feats = SKX if avx512 else "+64bit,+avx,+avx2,+fma,+f16c,+popcnt,-avx512f"
        monkeypatch.setattr(vw, "host_features", lambda: feats)
        monkeypatch.setattr(vw, "host_cpu_name", lambda: "cascadelake" if avx512 else "haswell")
        return vw

    return make


def test_precedence_user_then_env_then_measured_then_default(host):
    v = host(True)
    assert v.candidates() == ("512", "256")
    env = {}
    assert v.target(env) == ("default", v.features_for("512"))
    v.record("256", {"512": 0.2, "256": 0.1})
    assert v.chosen()["width"] == "256" and v.chosen()["seconds"] == {"512": 0.2, "256": 0.1}
    assert v.target(env) == ("measured", v.features_for("256"))
    assert v.target({"ZNNI_VECTOR_WIDTH": "512"}) == ("env", v.features_for("512"))
    assert v.target({"ZNNI_VECTOR_WIDTH": "host"}) == ("llvm", None)
    assert v.target({"ZNNI_VECTOR_WIDTH": "512", "NUMBA_CPU_NAME": "haswell"}) == ("user", None)
    assert v.target({"NUMBA_CPU_FEATURES": "+avx2"}) == ("user", None)
    with pytest.warns(UserWarning, match="ZNNI_VECTOR_WIDTH='1024'"):
        assert v.target({"ZNNI_VECTOR_WIDTH": "1024"}) == ("llvm", None)
    cfg = types.SimpleNamespace(CPU_FEATURES=None)
    assert v.apply(cfg, env) == "measured" and cfg.CPU_FEATURES == v.features_for("256") and env == {}


def test_the_default_width_holds_unless_the_other_is_clearly_faster():
    from znni_core.warmup import WIDTH_TIE, choose_width

    assert choose_width({"512": 0.091, "256": 0.088}) == "512"  # within the tie: the default
    assert choose_width({"512": 1.0, "256": 1.0 / (1 + 2 * WIDTH_TIE)}) == "256"
    assert choose_width({"512": 0.5, "256": 0.6}) == "512"


def test_the_register_tiles_follow_the_features_numba_compiles_for(monkeypatch):
    """The tiles' vector length and registers come from ``NUMBA_CPU_FEATURES`` when set, else from
    the host, whatever ``NUMBA_CPU_NAME`` is: numba passes the host's features with any CPU name
    (``NUMBA_CPU_NAME=znver3`` alone compiled zmm code on a Zen 4 host)."""
    from znni_core.layers import microkernel as mk

    cfg = mk.numba.config
    monkeypatch.setattr(cfg, "CPU_FEATURES", ZEN3)
    monkeypatch.setattr(cfg, "CPU_NAME", "znver3")
    assert mk._target_features() == ZEN3.split(",")
    monkeypatch.setattr(cfg, "CPU_FEATURES", None)
    assert mk._target_features() == vw.host_features().split(",")


def test_feature_strings_differ_only_in_the_width_flag(host):
    v = host(True)
    a, b = v.features_for("512").split(","), v.features_for("256").split(",")
    assert a[:-1] == b[:-1] == SKX.split(",")
    assert (a[-1], b[-1]) == ("-prefer-256-bit", "+prefer-256-bit")
    with pytest.raises(ValueError, match="'128'"):
        v.features_for("128")


def test_a_host_without_avx512_has_one_width_and_no_choice(host):
    v = host(False)
    assert v.candidates() == ()
    v.record("512", {"512": 0.1})  # even a stray entry (a copied cache) is not applied
    assert v.target({}) == ("llvm", None) and v.target({"ZNNI_VECTOR_WIDTH": "256"}) == ("llvm", None)


def test_choices_are_kept_per_host_and_a_corrupt_file_is_only_a_cache(host, monkeypatch):
    v = host(True)
    v.record("256", {"256": 1.0})
    monkeypatch.setattr(v, "host_cpu_name", lambda: "icelake-server")
    assert v.chosen() is None  # another host type: its own entry
    v.record("512", {"512": 1.0})
    data = json.loads(v.choice_path().read_text())
    assert sorted(e["width"] for e in data.values()) == ["256", "512"]
    v.choice_path().write_text("{not json")
    assert v.chosen() is None and v.target({})[0] == "default"


_EXACT = textwrap.dedent("""
    import json, os, sys
    import numpy as np
    from znni_core import layers as L
    from znni_core.layers import epilogue, microkernel, pointwise, tuning, _numba
    import tests.test_layers_conv as t
    want_vl, want_regs, want_src = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    got = (pointwise.VL, microkernel.REGISTERS, _numba.VECTOR_WIDTH_SOURCE)
    assert got == (want_vl, want_regs, want_src), got
    rng = np.random.default_rng(3)
    errs = {}
    for n, ci, co, shape, k in ((2, 5, 7, (3, 17, 19), (1, 3, 3)), (1, 4, 6, (7, 9, 11), (3, 3, 3)),
                                (3, 3, 4, (2, 20, 21), (1, 5, 5))):
        x = rng.standard_normal((n, ci) + shape, dtype=np.float32)
        w = rng.standard_normal((co, ci) + k, dtype=np.float32)
        b = rng.standard_normal(co, dtype=np.float32)
        ref = t.reference(x, w, b)
        errs[f"winograd {k}"] = t.rel_err(L.WinogradConv(w, b, shape, threads=2)(x), ref)
        with tuning.using({"winograd.blas": 1}):
            errs[f"winograd {k} blas"] = t.rel_err(L.WinogradConv(w, b, shape, threads=2)(x), ref)
        errs[f"direct-numba {k}"] = t.rel_err(L.conv_direct_numba(x, w, b), ref)
    for co in (5, 1):  # register tiles: rows of 68 values (a tile and a part of every width)
        x = rng.standard_normal((1, 3, 2, 5, 70), dtype=np.float32)
        w = rng.standard_normal((co, 3, 1, 3, 3), dtype=np.float32)
        b = rng.standard_normal(co, dtype=np.float32)
        errs[f"direct-numba tiles {co}"] = t.rel_err(L.conv_direct_numba(x, w, b, tiles=True), t.reference(x, w, b))
    x, stages = t._wide_chain(5)
    y = pointwise.conv_pointwise_chain(x, stages, threads=2, block=48)
    errs["1x1x1 chain"] = float(np.abs(y - t._pointwise_reference(x, stages)).max())
    x = rng.standard_normal((2, 3, 9, 10, 11), dtype=np.float32)  # fragments (4, 4, 5), item-major
    ref = np.stack([x[i, :, oz:oz + 8, oy:oy + 8, ox:ox + 10].reshape(3, 4, 2, 4, 2, 5, 2).max(axis=(2, 4, 6))
                    for i in range(2) for oz in range(2) for oy in range(2) for ox in range(2)])
    errs["mpf"] = float(np.abs(L.mpf(x, (2, 2, 2)) - ref).max())
    for shape in microkernel.SHAPES:  # every register tile, rows and columns not whole tiles
        A = rng.standard_normal((3, 29, 20), dtype=np.float32)
        B = rng.standard_normal((3, 20, 21), dtype=np.float32)
        C = np.empty((3, 29, 21), np.float32)
        microkernel.batched_products(A, microkernel.pad_columns(B, shape), C, 29, 21, microkernel.Scratch(20, 21, shape))
        errs[f"tile {shape}"] = t.rel_err(C, np.matmul(A.astype(np.float64), B))
    # the activations and the in-place maxima on special values: NaN kept, ReLU of -0 is +0
    v = np.array([np.nan, np.inf, -np.inf, -0.0, 0.0, -2.0, 3.0] * 5, np.float32).reshape(1, 5, 1, 1, 7)
    for kind, alpha, want in (("relu", 0.0, np.maximum(v, 0)), ("leaky_relu", 0.1, np.where(v > 0, v, 0.1 * v)),
                              ("elu", 1.0, np.where(v > 0, v, np.expm1(np.minimum(v, 0))))):
        got = epilogue.add_affine_act(v, None, None, None, (kind, alpha))
        errs[kind] = 0.0 if np.allclose(got, want + 0.0, equal_nan=True) and not np.signbit(got[v == 0]).any() else 1.0
    x = rng.standard_normal((1, 2, 6, 7, 8), dtype=np.float32)
    y = x.copy()
    L.max_filter_inplace(y, (2, 2, 2))
    ref = np.max([x[:, :, a:a + 5, b:b + 6, c:c + 7] for a in (0, 1) for b in (0, 1) for c in (0, 1)], axis=0)
    errs["max filter"] = float(np.abs(y[:, :, :5, :6, :7] - ref).max())
    # stores under a mask (vmaskmovps: microcoded on AMD cores) in the code compiled here
    import re
    from znni_core.layers import direct, pool, winograd
    asm = {f"{m.__name__}.{name}": f.inspect_asm(sig)
           for m in (direct, epilogue, pool, pointwise, winograd) for name, f in vars(m).items()
           if hasattr(f, "inspect_asm") and getattr(f, "signatures", None) for sig in f.signatures}
    masked = {k: len(re.findall("vmaskmov", a)) for k, a in asm.items()}
    scattered = {k: len(re.findall("vp?scatter", a)) for k, a in asm.items()}
    print(json.dumps({"errs": errs, "masked": masked, "scattered": scattered}))
""")


def _python(args, env, timeout=900):
    """``python ARGS`` in the project's root; fails the test with its stderr unless it exits 0."""
    r = subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def _run_variant(env_extra, want_vl, want_regs, want_src, tmp_path):
    env = {
        k: v for k, v in os.environ.items() if k not in ("NUMBA_CPU_FEATURES", "NUMBA_CPU_NAME", "ZNNI_VECTOR_WIDTH")
    }
    env.update(NUMBA_CACHE_DIR=str(tmp_path / "numba"), ZNNI_CACHE_DIR=str(tmp_path), **env_extra)
    r = _python(["-c", _EXACT, str(want_vl), str(want_regs), want_src], env, timeout=600)
    return json.loads(r.stdout.strip().splitlines()[-1])


def _masked_store_free(masked: dict):
    """No kernel stores under a mask: LLVM compiles a select stored back where one of its values
    was read to ``vmaskmovps`` in AVX2 code, microcoded on AMD cores (ReLU in place ran 8x
    slower than with a plain store on Zen 4); the kernels store sums of selects instead."""
    assert len(masked) >= 10, masked  # the kernels ran here, freshly compiled
    assert not {k: n for k, n in masked.items() if n}, masked


def _scatter_free(scattered: dict):
    """No kernel stores through a scatter (AVX-512 code): a loop indexed with signed integers
    (numba wraps a negative index) compiled to ``vscatterdps``, microcoded on Zen 4, and the
    Winograd input transform's edge-row copies ran 3-4x slower than in AVX2 code.  The 1x1x1
    chain's block transposition is the exception, for what is left past its whole 8 x 8 blocks
    (those are transposed in registers): one side of a transposition is strided, a scatter or a
    gather either way."""
    assert len(scattered) >= 10, scattered
    assert not {k: n for k, n in scattered.items() if n and not k.startswith("znni_core.layers.pointwise.")}, scattered


@pytest.mark.parametrize("variant", ["256-bit", "znver3"])
def test_kernels_compiled_for_another_width_are_exact(variant, tmp_path):
    """Winograd (4-, 6- and 8-point tiles, products on the register tiles and on BLAS), the direct
    loop, the 1x1x1 chain and every register tile compiled for 256-bit vectors on an AVX-512 host
    (what LLVM picks for Intel server cores: 8 floats, 32 registers) and for a Zen 3's AVX2 (its
    name and features: 8 floats, 16 registers): equal to the float64 references (the default
    width runs in every other test)."""
    if variant == "256-bit":
        if not AVX512:
            pytest.skip("this host has no AVX-512: it has one width, the AVX2 case covers it")
        got = _run_variant({"ZNNI_VECTOR_WIDTH": "256"}, 8, 32, "env", tmp_path)
        _scatter_free(got["scattered"])
    else:
        got = _run_variant({"NUMBA_CPU_NAME": "znver3", "NUMBA_CPU_FEATURES": ZEN3}, 8, 16, "user", tmp_path)
        _masked_store_free(got["masked"])
    errs = got["errs"]
    assert len(errs) == 11 + 2 + 5 + 4  # 2: direct-numba on register tiles, 4 and 1 channels
    bad = {k: e for k, e in errs.items() if not e < 1e-4}
    assert not bad, bad


@pytest.mark.slow
def test_warmup_compiles_everything_quickly_then_refines(tmp_path):
    """``znni warmup`` on a fresh cache: every kernel compiled (two processes) and a quick
    calibration, the vector width left unmeasured; a new process running networks (as a job
    does) then compiles nothing.  ``--refine``: on an AVX-512 host both widths timed on every case
    and the faster recorded (the default on a tie), and a full calibration replaces the quick one."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("NUMBA_CPU_FEATURES", "NUMBA_CPU_NAME", "ZNNI_VECTOR_WIDTH", "NUMBA_CACHE_DIR")
    }
    env["ZNNI_CACHE_DIR"] = str(tmp_path)

    def warmup(*flags):
        return _python(["-m", "znni_core.cli", "warmup", "--threads", "1", *flags], env).stderr

    def levels():
        return [e["level"] for e in json.loads((tmp_path / "calibration.json").read_text()).values()]

    said = warmup()
    assert "compiling znni's kernels (2 processes)" in said and "--refine" in said
    # the calibration, started after the first group, timed nothing the second still compiled
    assert "compiled" not in said.split("warm:")[-1], said
    assert levels() == ["quick"] and not (tmp_path / "vector_width.json").exists()
    kernels = lambda: sorted(p.name for p in (tmp_path / "numba").rglob("*.nbc"))  # noqa: E731
    before = kernels()
    assert len(before) >= 20
    # one compilation a kernel (``<function>.py311.<n>.nbc``: n counts its signatures): a literal
    # argument at a call site compiled a kernel again for it (a second of the compile each)
    assert [k for k in before if not k.endswith(".1.nbc")] == [], before
    job = textwrap.dedent("""
        import json
        from znni_core.warmup import _run_networks
        print(json.dumps(_run_networks(1)))
    """)
    r = _python(["-c", job], dict(env, NUMBA_CACHE_DIR=str(tmp_path / "numba")))
    ran = json.loads(r.stdout.strip().splitlines()[-1])
    assert ran["runs"] >= 20 and ran["compiled"] == 0, ran
    assert kernels() == before

    warmup("--refine")
    # the full calibration is the one keyed by the width the refine chose; when that is not the width
    # the quick one ran at (a loaded host can time 256-bit code faster), the quick entry keeps its key
    key = _python(["-c", "from znni_core.plan.timing import machine_key; print(machine_key(1))"], env).stdout.split()[
        -1
    ]
    cal = json.loads((tmp_path / "calibration.json").read_text())
    assert cal[key]["level"] == "full" and levels().count("full") == 1, (key, levels())
    # the full calibration timed every kernel parameter's every candidate and chose one of them
    tuned, tried = cal[key]["tuned"], cal[key]["tuning_seconds"]
    assert set(tuned) == set(tried) == set(tuning.DEFAULTS)
    assert all(tuned[k] in tuning.CANDIDATES[k] for k in tuning.DEFAULTS), tuned
    assert all([v for v, _ in tried[k]] == list(tuning.CANDIDATES[k]) for k in tuning.DEFAULTS), tried
    assert levels() == ["full"] or (AVX512 and sorted(levels()) == ["full", "quick"])
    if AVX512:
        (entry,) = json.loads((tmp_path / "vector_width.json").read_text()).values()
        from znni_core.warmup import WIDTH_CASES, choose_width

        assert set(entry["seconds"]) == {"512", "256"} and entry["width"] == choose_width(entry["seconds"])
        assert all(sorted(c) == sorted(WIDTH_CASES) for c in entry["cases"].values())


def test_a_compile_child_that_fails_stops_the_warmup_with_its_error():
    """The compile children start together; one that fails ends the warmup with its own error,
    and the other is not left running."""
    from znni_core import warmup as w

    with pytest.raises(RuntimeError, match=r"(?s)the step compile bogus failed.*compile group 'bogus'"):
        w._children([["compile", "bogus"], ["compile", "winograd-in"]], dict(os.environ), timeout=300)


def test_a_width_child_that_fails_stops_the_warmup_with_its_error():
    """Both width children start; one that fails before it has compiled ends the warmup with its
    own error (read from its stderr file), and no child is left running."""
    from znni_core import warmup as w

    with pytest.raises(RuntimeError, match=r"(?s)the step width bogus failed.*invalid literal"):
        w._width_children(["512", "256"], "bogus", dict(os.environ), timeout=120)
