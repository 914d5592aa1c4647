"""The register tiles (``layers/microkernel.py``) against float64 products.

Every tile shape the host's ISA has, on products whose rows and columns are and are not whole
tiles (the scratch tiles), with ``C`` padded (whole tiles written in place) and not, each
position range on its own; the shape rule; the 1x1x1 chains and Winograd layers that run on the
tiles are checked in ``tests/test_layers_conv.py`` and ``tests/test_winograd.py``, and under the
other ISA builds in ``tests/test_vector_width.py``.
"""

from __future__ import annotations

import numpy as np
import pytest

from znni_core.layers import microkernel as mk


def _product(rng, T, n, K, N, shape, padded, extra_rows):
    """``A``, ``B`` and a NaN-filled ``C``, its rows whole tiles of ``shape`` when ``padded``."""
    A = rng.standard_normal((T, n + extra_rows, K), dtype=np.float32)
    B = rng.standard_normal((T, K, N), dtype=np.float32)
    ldc = mk.padded_columns(N, shape) if padded else N
    C = np.full((T, n + extra_rows, ldc), np.nan, np.float32)
    return A, B, C


def _guarded(T, n, N):
    """``C`` (T, n, N) C-contiguous inside a flat NaN buffer with room after it, and that buffer."""
    flat = np.full(T * n * N + 4096, np.nan, np.float32)
    return flat[: T * n * N].reshape(T, n, N), flat


@pytest.mark.parametrize("shape", mk.SHAPES)
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize(
    "T,n,K,N", [(3, 37, 5, 7), (2, 64, 48, 48), (4, 29, 24, 24), (1, 11, 80, 80), (2, 50, 33, 17), (1, 1, 1, 1)]
)
def test_products_equal_float64(shape, padded, T, n, K, N):
    rng = np.random.default_rng(T * 1000 + n + K + N)
    A, B, C = _product(rng, T, n, K, N, shape, padded, extra_rows=mk.SHAPES[0][0] if padded else 0)
    if not padded:  # C exactly (T, n, N) inside a larger buffer: nothing may be written past it
        C, flat = _guarded(T, n, N)
    mk.batched_products(A, mk.pad_columns(B, shape), C, n, N, mk.Scratch(K, N, shape))
    ref = np.matmul(A[:, :n].astype(np.float64), B.astype(np.float64))
    err = np.abs(C[:, :n, :N] - ref).max() / max(np.abs(ref).max(), 1e-30)
    assert err < 1e-5, (shape, err)
    if not padded:
        assert np.isnan(flat[T * n * N :]).all()


def test_a_range_of_positions_writes_only_those():
    rng = np.random.default_rng(5)
    A, B, C = _product(rng, 6, 40, 16, 24, None, True, 0)
    mk.batched_products(A, mk.pad_columns(B), C, 40, 24, mk.Scratch(16, 24), 2, 4)
    ref = np.matmul(A.astype(np.float64), B.astype(np.float64))
    np.testing.assert_allclose(C[2:4, :, :24], ref[2:4], rtol=1e-5, atol=1e-4)
    assert np.isnan(C[:2]).all() and np.isnan(C[4:]).all()


def test_tile_shapes_fit_the_registers_and_pad_least():
    assert all(mk.fits(r, nv) and not mk.fits(r + 1, nv) for r, nv, _ in mk.SHAPES)
    assert {vl for _, _, vl in mk.SHAPES} == ({16, 8} if mk.VL == 16 else {8})
    for n in (1, 7, 16, 24, 36, 48, 64, 80, 96, 128):
        shape = mk.tile_shape(n)
        least = min(-(-n // (v * w)) * v * w for _, v, w in mk.SHAPES)
        assert mk.padded_columns(n, shape) == least == mk.padded_columns(n)
        assert shape[2] == max(w for _, v, w in mk.SHAPES if mk.padded_columns(n, (_, v, w)) == least)


def test_wide_tile_shapes_take_the_fewest_vectors_per_row():
    """``wide`` (``winograd.wide_tiles``): the fewest vectors per row of a tile first, then the
    fewest padded columns; in a 512-bit build 24 and 36 maps take 16-float tiles (2 and 3 vectors,
    32 and 48 columns) where the narrow rule takes 8-float ones (3 and 5, 24 and 40); in an 8-float
    build the two rules agree."""
    for n in (1, 7, 16, 24, 28, 36, 40, 48, 64, 80):
        r, nv, vl = mk.tile_shape(n, wide=True)
        vectors = min(-(-n // (v * w)) * v for _, v, w in mk.SHAPES)
        assert -(-n // (nv * vl)) * nv == vectors
        assert mk.padded_columns(n, wide=True) == mk.padded_columns(n, (r, nv, vl)) >= mk.padded_columns(n)
        if mk.VL == 8:
            assert mk.tile_shape(n, wide=True) == mk.tile_shape(n)
    if mk.VL == 16:
        assert mk.tile_shape(36) == (5, 5, 8) and mk.tile_shape(36, wide=True) == (9, 3, 16)
        assert mk.tile_shape(24) == (9, 3, 8) and mk.tile_shape(24, wide=True) == (14, 2, 16)
        assert mk.tile_shape(48, wide=True) == mk.tile_shape(48) == (9, 3, 16)


def test_mismatched_buffers_are_refused():
    rng = np.random.default_rng(0)
    A, B, C = _product(rng, 2, 10, 8, 8, None, False, 0)
    with pytest.raises(ValueError, match="scratch for K=4"):
        mk.batched_products(A, mk.pad_columns(B), C, 10, 8, mk.Scratch(4, 8))
    A2, B2, C2 = _product(rng, 2, 10, 8, 12, None, False, 0)
    with pytest.raises(ValueError, match="products of"):
        mk.batched_products(A2, B2, C2, 10, 12, mk.Scratch(8, 12))  # B without whole tiles of columns
    with pytest.raises(ValueError, match="products of"):
        mk.batched_products(A, mk.pad_columns(B), C, 11, 8, mk.Scratch(8, 8))
    with pytest.raises(ValueError, match="tile shape"):
        mk.Scratch(8, 8, (3, 3, 8))
