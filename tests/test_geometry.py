"""Geometry: hand-checkable cases, and docs/reliability.md T11 as a property over random geometries."""

from __future__ import annotations

import dataclasses
import doctest

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import znni_core.geometry as G
from znni_core.geometry import ChunkGrid, Coordinate, Halo, Roi, coordinate, create_blocks, grid, output_bounds, roi


@pytest.mark.parametrize("mod", [coordinate, roi, grid])
def test_doctests(mod):
    assert doctest.testmod(mod).failed == 0


def test_coordinate_refuses_fractions_and_mismatch():
    with pytest.raises(ValueError, match="whole numbers"):
        Coordinate(1.5, 2, 3)
    with pytest.raises(ValueError, match="dimension mismatch"):
        Coordinate(1, 2, 3) + (1, 2)
    assert Coordinate(5, 7, 9).ceil_div(4) == (2, 2, 3)
    assert Coordinate(1, 2, 3).xyz() == (3, 2, 1)
    assert Coordinate.from_xyz((3, 2, 1)) == (1, 2, 3)


def test_roi_basics():
    r = Roi((0, 0, 0), (10, 10, 10))
    assert r.grow(1).shape == (12, 12, 12)
    assert r.intersect(Roi((8, 8, 8), (5, 5, 5))) == Roi((8, 8, 8), (2, 2, 2))
    assert r.intersect(Roi((20, 0, 0), (1, 1, 1))).empty
    assert r.snap_to_grid(4, mode="grow") == Roi((0, 0, 0), (12, 12, 12))
    assert Roi((1, 1, 1), (9, 9, 9)).snap_to_grid(4, mode="shrink") == Roi((4, 4, 4), (4, 4, 4))
    assert r.to_slices((0, 0, 0)) == (slice(0, 10),) * 3
    with pytest.raises(ValueError, match=">= 0"):
        Roi((0, 0, 0), (-1, 1, 1))
    with pytest.raises(ValueError, match="leaves nothing"):
        r.grow(-6)
    assert Roi.from_dict(r.to_dict()) == r
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.offset = Coordinate(1, 1, 1)  # frozen


def test_halo_from_field_of_view():
    h = Halo.from_field_of_view((5, 12, 12))
    assert h.low == (2, 5, 5) and h.high == (2, 6, 6)
    assert h.field_of_view == (5, 12, 12)
    assert h.read_roi(Roi((10, 10, 10), (1, 1, 1))) == Roi((8, 5, 5), (5, 12, 12))


def test_output_bounds_by_edge_policy():
    h = Halo.from_field_of_view((3, 5, 5))
    ib = Roi((0, 0, 0), (10, 20, 20))
    assert output_bounds(ib, h, "valid") == Roi((1, 2, 2), (8, 16, 16))
    assert output_bounds(ib, h, "mirror") == ib
    with pytest.raises(ValueError, match="smaller than the field of view"):
        output_bounds(Roi((0, 0, 0), (2, 2, 2)), h, "valid")


def test_task_ids_are_stable_across_regions():
    g = ChunkGrid(Roi((0, 0, 0), (8, 64, 64)), (4, 16, 16))
    h = Halo((1, 1, 1), (1, 1, 1))
    whole = {b.id: b for b in create_blocks(g, (1, 2, 2), h)}
    sub = create_blocks(g, (1, 2, 2), h, Roi((4, 30, 30), (2, 4, 4)))
    assert len(sub) == 4
    for b in sub:  # a sub-region's task is the part of the same global task inside the region
        assert set(b.chunks) <= set(whole[b.id].chunks)
        assert whole[b.id].write_roi.contains(b.write_roi)


@st.composite
def geometries(draw):
    off = Coordinate(*(draw(st.integers(-50, 50)) for _ in range(3)))
    shape = Coordinate(*(draw(st.integers(1, 40)) for _ in range(3)))
    chunk = Coordinate(*(draw(st.integers(1, 12)) for _ in range(3)))
    tc = Coordinate(*(draw(st.integers(1, 4)) for _ in range(3)))
    fov = Coordinate(*(draw(st.integers(1, 9)) for _ in range(3)))
    return Roi(off, shape), chunk, tc, Halo.from_field_of_view(fov)


@settings(max_examples=150, deadline=None)
@given(geometries())
def test_T11_tasks_disjoint_aligned_covering(geo):
    """docs/reliability.md, T11: write ROIs disjoint, chunk-aligned (except the volume edge), covering the bounds."""
    bounds, chunk, tc, halo = geo
    g = ChunkGrid(bounds, chunk)
    blocks = create_blocks(g, tc, halo)
    assert sum(b.write_roi.size for b in blocks) == bounds.size  # cover + disjoint (with the checks below)
    seen = set()
    for b in blocks:
        assert bounds.contains(b.write_roi)
        assert g.is_aligned(b.write_roi)
        assert b.read_roi == b.write_roi.grow(halo.low, halo.high)
        # begin on the grid; end on the grid or at the bounds' end
        rel_b = b.write_roi.begin - bounds.offset
        assert all(v % c == 0 for v, c in zip(rel_b, chunk))
        for e, be, c, o in zip(b.write_roi.end, bounds.end, chunk, bounds.offset):
            assert e == be or (e - o) % c == 0
        chunk_union = sum(g.chunk_roi(i).size for i in b.chunks)
        assert chunk_union == b.write_roi.size
        for i in b.chunks:
            assert i not in seen
            seen.add(i)
        assert b.id not in {x.id for x in blocks if x is not b}
    assert len(seen) == g.num_chunks


def test_public_names():
    for name in G.__all__:
        assert hasattr(G, name)


def test_chunk_box_is_the_chunk_clipped_to_the_bounds():
    """chunk_box (plain ints, used to name chunks) equals the chunk's Roi intersected with the
    bounds, for every chunk of a grid whose bounds are neither at 0 nor a multiple of the chunk."""
    bounds = Roi((3, 47, 5), (15, 418, 100))
    g = ChunkGrid(bounds, (8, 64, 64))
    n = 0
    for idx in g.chunks_in(bounds):
        b, e = g.chunk_box(idx)
        ref = Roi(tuple(o + i * c for o, i, c in zip((3, 47, 5), idx, (8, 64, 64))), (8, 64, 64)).intersect(bounds)
        assert (b, e) == (tuple(ref.begin), tuple(ref.end)) and g.chunk_roi(idx) == ref
        n += 1
    assert n == 2 * 7 * 2
    with pytest.raises(IndexError):
        g.chunk_box((0, 7, 0))
