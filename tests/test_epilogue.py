"""The fused activations of the conv output passes (``layers/epilogue.py``) against float64
numpy: the arithmetic ``exp``, every code, the 1x1x1 chain that applies them in cache, and the
Winograd output transform that applies them in registers."""

from __future__ import annotations

import numpy as np
import pytest

from znni_core.layers import apply_activation, conv_pointwise_chain
from znni_core.layers._numba import njit
from znni_core.layers.epilogue import FUSABLE, NONE, act_row, epilogue, exp_neg, vector_transform_act
from znni_core.layers.microkernel import VL
from znni_core.layers.transform_vectors import AT8


@njit(cache=False)
def _exp_all(x, out):  # pragma: no cover - compiled
    for i in range(x.size):
        out[i] = exp_neg(x[i])


@njit(cache=False)
def _act_all(x, out, code, alpha):  # pragma: no cover - compiled
    out[:] = x
    act_row(out, 0, out.size, code, alpha)


def test_exp_neg_is_float32_exact_over_its_range():
    x = np.concatenate([np.linspace(-87.0, 0.0, 2_000_001), -np.logspace(-30, 1.9, 100_001), [0.0, -1e-45]])
    x = x.astype(np.float32)
    got = np.empty_like(x)
    _exp_all(x, got)
    ref = np.exp(x.astype(np.float64))
    rel = np.abs(got - ref) / ref
    assert rel.max() <= 3e-7, (rel.max(), x[rel.argmax()])
    assert got[x == 0].tolist() == [1.0, 1.0]
    low = np.array([-88.0, -1e4, -np.inf], np.float32)  # clamped to e^-87, never a subnormal or NaN
    _exp_all(low, got[:3])
    assert np.all(got[:3] == got[:3][0]) and 0 < got[0] < 2e-38


@pytest.mark.parametrize(
    "kind,alpha",
    [("relu", 0.0), ("leaky_relu", 0.01), ("leaky_relu", 1.7), ("elu", 1.0), ("elu", 0.3), ("identity", 0.0)],
)
def test_each_code_equals_apply_activation(kind, alpha):
    rng = np.random.default_rng(1)
    x = np.concatenate([rng.standard_normal(100_000) * 4, [0.0, -0.0, 1e-8, -1e-8, -100.0, 100.0]]).astype(np.float32)
    got = np.empty_like(x)
    code, a = epilogue((kind, alpha))
    _act_all(x, got, code, np.float32(a))
    ref = apply_activation(x.astype(np.float64), kind, alpha)
    assert (np.abs(got - ref) / np.maximum(1.0, np.abs(ref))).max() <= 2.5e-7, kind  # float32 rounding


def test_epilogue_codes_and_refusals():
    assert epilogue(None) == epilogue(("identity", 0.0)) == NONE == (0, 0.0)
    assert {k: epilogue((k, 0.5)) for k in FUSABLE} == {"relu": (1, 0.5), "leaky_relu": (2, 0.5), "elu": (3, 0.5)}
    for kind in ("sigmoid", "tanh", "softmax"):
        with pytest.raises(KeyError):
            epilogue((kind, 0.0))


def test_pointwise_chain_applies_elu_in_cache():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((1, 6, 5, 40, 41)).astype(np.float32)
    stages = [
        (
            rng.standard_normal((8, 6, 1, 1, 1)).astype(np.float32),
            rng.standard_normal(8).astype(np.float32),
            ("elu", 0.6),
        ),
        (rng.standard_normal((3, 8, 1, 1, 1)).astype(np.float32), None, ("sigmoid", 0.0)),
    ]
    ref = x.astype(np.float64)
    for w, b, (kind, alpha) in stages:
        ref = np.einsum("oc,nczyx->nozyx", w[:, :, 0, 0, 0].astype(np.float64), ref)
        if b is not None:
            ref += b.reshape(1, -1, 1, 1, 1)
        ref = apply_activation(ref, kind, alpha)
    got = conv_pointwise_chain(x, stages, threads=2, block=1000)
    assert np.abs(got - ref).max() <= 1e-5


def test_add_affine_act_equals_three_passes_on_views():
    from znni_core.layers.epilogue import add_affine_act

    rng = np.random.default_rng(3)
    a = rng.standard_normal((2, 5, 4, 30, 31)).astype(np.float32)
    b = rng.standard_normal((2, 5, 6, 33, 35)).astype(np.float32)[:, :, 1:5, 2:32, 3:34]  # a strided view
    s, t = rng.standard_normal(5).astype(np.float32), rng.standard_normal(5).astype(np.float32)
    for scale, shift, fused in ((s, t, ("elu", 0.5)), (None, None, ("leaky_relu", 0.1)), (s[:1], None, None)):
        ref = a.astype(np.float64) + b
        ref = ref * (1.0 if scale is None else scale.reshape(1, -1, 1, 1, 1)) + (
            0.0 if shift is None else shift.reshape(1, -1, 1, 1, 1)
        )
        ref = apply_activation(ref, *(fused or ("identity", 0.0)))
        assert np.abs(add_affine_act(a, b, scale, shift, fused) - ref).max() <= 1e-6
    into = a.copy()  # in place into an input, and without b: act(s a + t)
    assert add_affine_act(into, None, s, t, ("relu", 0.0), out=into) is into
    assert np.abs(into - np.maximum(a * s.reshape(1, -1, 1, 1, 1) + t.reshape(1, -1, 1, 1, 1), 0)).max() <= 1e-6


def _transform_pair(kind, vl, code):
    """Two compiled calls of the output transform ``kind`` on ``vl`` lanes: with the epilogue
    ``code`` fused (:func:`vector_transform_act`), and as the transform, the bias and
    :func:`act_row` one after another."""
    from znni_core.layers.transform_vectors import vector_transform

    @njit(cache=False)
    def fused(d, v, bias, alpha):  # pragma: no cover - compiled
        u = np.uint64
        offs = (u(vl), u(2 * vl), u(3 * vl), u(4 * vl), u(5 * vl), u(6 * vl), u(7 * vl))
        vector_transform_act(kind, vl, d, u(0), offs, v, u(0), u(vl), bias, u(0), code, alpha)

    @njit(cache=False)
    def apart(d, v, bias, alpha):  # pragma: no cover - compiled
        u = np.uint64
        offs = (u(vl), u(2 * vl), u(3 * vl), u(4 * vl), u(5 * vl), u(6 * vl), u(7 * vl))
        vector_transform(kind, vl, d, u(0), offs, v, u(0), u(vl))
        for i in range(v.size):
            v[i] += bias[i % vl]
        act_row(v, 0, v.size, code, alpha)

    return fused, apart


@pytest.mark.parametrize("m", [4, 6, 7])
@pytest.mark.parametrize("vl", sorted({8, VL}))
def test_output_transform_with_fused_epilogue_equals_the_passes_apart(m, vl):
    """The output transform with bias and activation in registers gives the values, bit for bit, of
    the transform, the bias and :func:`act_row` as separate passes, for every code: NaN kept,
    -0, infinities and values far below ELU's clamp among random ones of every scale."""
    rng = np.random.default_rng(m * 100 + vl)
    special = np.array([np.nan, -0.0, 0.0, -np.inf, np.inf, -200.0, 1e-30], np.float32)
    for code in range(4):
        fused, apart = _transform_pair(AT8 + m, vl, code)
        for _ in range(40):
            d = (rng.standard_normal(8 * vl) * rng.choice([1e-3, 1.0, 30.0, 1e3])).astype(np.float32)
            d[rng.integers(0, d.size, 3)] = rng.choice(special, 3)
            bias = rng.standard_normal(vl).astype(np.float32)
            got, ref = np.full(m * vl, 9.0, np.float32), np.empty(m * vl, np.float32)
            fused(d, got, bias, np.float32(0.7))
            apart(d, ref, bias, np.float32(0.7))
            assert np.array_equal(got.view(np.int32), ref.view(np.int32)), (code, got, ref)
