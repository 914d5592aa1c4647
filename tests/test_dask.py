"""``znni_core.dask.infer_dask`` against ``infer`` on the whole array: chains, valid and padded
U-Nets, blocks that do not divide the output, a process cluster writing with ``to_zarr``."""

from __future__ import annotations

import warnings

import dask.array as da
import numpy as np
import pytest

import znni_core
from znni_core.dask import block_shape, infer_dask
from znni_core.errors import InputError, PlanError
from znni_core.net import Activation, Conv, Network, Pool
from znni_core.plan import autotune


def _chain():
    rng = np.random.default_rng(0)
    w = lambda o, i, k: rng.standard_normal((o, i) + k).astype(np.float32) / np.sqrt(i * np.prod(k))  # noqa: E731
    return Network(
        (
            Conv(w(3, 1, (1, 3, 3)), rng.standard_normal(3).astype(np.float32)),
            Activation("relu"),
            Pool((1, 2, 2)),
            Conv(w(2, 3, (3, 3, 3)), np.zeros(2, np.float32)),
        )
    )


#: the plans a block and the whole volume make for themselves may choose different convolution
#: primitives (the host's timings decide: a 5^3 block's plan took FFT where the whole took direct
#: convolution), whose sums round differently
ROUNDING = {"rtol": 1e-5, "atol": 1e-6}


def test_a_chain_on_a_dask_array_equals_infer_on_the_whole_array():
    """Blocks of any shape assemble ``infer``'s output: bit for bit under one plan of direct
    convolutions (each voxel's sums in one order wherever its patch sits), within float32
    rounding under the plans each makes for itself."""
    net = _chain()
    x = np.random.default_rng(1).standard_normal((1, 9, 37, 41)).astype(np.float32)
    direct = autotune(net, input_shape=x.shape[1:], primitives=("direct-numba",))
    exact, want = znni_core.infer(net, x, plan=direct), znni_core.infer(net, x)
    for chunks in ((4, 16, 16), (7, 35, 39), 5):
        xd = da.from_array(x, chunks=(1, 4, 11, 13))
        y = infer_dask(net, xd, chunks=chunks, plan=direct)
        assert y.shape == exact.shape and y.dtype == np.float32
        np.testing.assert_array_equal(y.compute(scheduler="threads"), exact)
        np.testing.assert_allclose(infer_dask(net, xd, chunks=chunks).compute(scheduler="threads"), want, **ROUNDING)
    y = infer_dask(net, da.from_array(x[0], chunks=(4, 11, 13)))  # (Z, Y, X), the input's own chunks
    assert y.chunks[1:] == ((4, 3), (11, 11, 8), (13, 13, 8))
    np.testing.assert_allclose(y.compute(), want, **ROUNDING)


def test_bad_inputs_are_refused_naming_the_fix():
    net = _chain()
    with pytest.raises(InputError, match="float32"):
        infer_dask(net, da.zeros((9, 37, 41), dtype=np.uint8))
    with pytest.raises(InputError, match="field of view"):
        infer_dask(net, da.zeros((2, 5, 5), dtype=np.float32))
    with pytest.raises(InputError, match="chunks"):
        infer_dask(net, da.zeros((9, 37, 41), dtype=np.float32), chunks=(0, 4, 4))
    other = Network((Conv(np.ones((1, 1, 2, 2, 2), np.float32)),))
    with pytest.raises(PlanError, match="another network"):
        infer_dask(net, da.zeros((9, 37, 41), dtype=np.float32), plan=autotune(other, input_shape=(4, 4, 4)))
    x = np.zeros((9, 37, 41), np.float32)
    x[6, 3, 3] = np.nan
    with pytest.raises(InputError, match="NaN"):
        infer_dask(net, da.from_array(x), chunks=(4, 30, 30)).compute()


def test_a_precomputed_layer_read_as_a_dask_array_feeds_infer_dask(tmp_path):
    """``read_layer``: a precomputed layer (blocks other than its chunks) equals what tensorstore,
    an independent reader, reads; the network on it equals ``infer`` on the whole array."""
    ts = pytest.importorskip("tensorstore")
    from znni_core.dask import read_layer
    from znni_core.pipeline.demo import write_demo

    write_demo(tmp_path, shape=(8, 40, 36), chunk=(4, 16, 16))
    url = f"file://{tmp_path}/em"
    x = read_layer(url, chunks=(3, 20, 20))
    assert x.shape == (1, 8, 40, 36) and x.dtype == np.uint8 and x.chunks[2] == (20, 20)
    t = ts.open({"driver": "neuroglancer_precomputed", "kvstore": f"file://{tmp_path}/em"}).result()
    want = np.asarray(t.read().result()).transpose(3, 2, 1, 0)  # (x, y, z, c) -> (c, z, y, x)
    got = x.compute()
    np.testing.assert_array_equal(got, want)
    net = znni_core.load_network(tmp_path / "net.yaml")
    y = infer_dask(net, x.astype(np.float32) / 255, chunks=(4, 16, 16))
    np.testing.assert_allclose(y.compute(), znni_core.infer(net, want.astype(np.float32) / 255), **ROUNDING)
    with pytest.raises(InputError, match="chunks"):
        read_layer(url, chunks=(0, 1, 1))


torch = pytest.importorskip("torch")
from .unets import UNet, admissible, export, randomise_bn  # noqa: E402


def _unet(tmp_path, valid):
    torch.manual_seed(0)
    model = randomise_bn(
        UNet(
            valid=valid,
            depth=1,
            kernel=(3, 3, 3),
            pool=(1, 2, 2),
            width=3,
            bn=not valid,
            merge="add" if valid else "concat",
        ),
        0,
    )
    shape = tuple(admissible(model, a, lo) for a, lo in enumerate((4, 20, 20))) if valid else (4, 16, 16)
    return znni_core.load_network(export(model, tmp_path / "u.onnx", shape, dynamic=True))


def test_a_valid_unet_on_a_dask_array_equals_infer_and_blocks_start_on_its_grid(tmp_path):
    net = _unet(tmp_path, valid=True)
    assert net.kind == "valid" and net.grid[1] > 1
    shape = tuple(net.geometry.n_min[a] + 5 * net.grid[a] for a in range(3))
    x = np.random.default_rng(2).standard_normal((1,) + shape).astype(np.float32)
    want = znni_core.infer(net, x)
    y = infer_dask(net, da.from_array(x, chunks=(1, 5, 17, 17)), chunks=(3, 5, 7))
    assert all(c % g == 0 for c, g in zip(block_shape(net, (3, 5, 7), want.shape[1:]), net.grid))
    np.testing.assert_allclose(y.compute(), want, **ROUNDING)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(UserWarning, match="not used"):  # an inadmissible input, as infer warns
            infer_dask(net, da.from_array(np.pad(x, [(0, 0), (0, 0), (0, 1), (0, 0)])))


def test_a_padded_unet_on_a_dask_array_blends_as_infer_on_the_whole_array(tmp_path):
    net = _unet(tmp_path, valid=False)
    assert net.kind == "padded"
    x = np.random.default_rng(3).standard_normal((1, 6, 50, 46)).astype(np.float32)
    plan = autotune(net, patch_shape=(6, 24, 24), overlap=(0, 8, 8), input_shape=x.shape[1:])
    want = znni_core.infer(net, x, plan=plan)
    y = infer_dask(net, da.from_array(x, chunks=(1, 3, 20, 20)), chunks=(6, 20, 17), plan=plan)
    assert y.shape == want.shape and len(y.chunks[2]) == 3
    np.testing.assert_allclose(y.compute(), want, rtol=1e-6, atol=1e-6)
    # the default plan is the one infer makes for the whole input: the same lattice
    np.testing.assert_allclose(infer_dask(net, x, chunks=(6, 25, 25)).compute(), znni_core.infer(net, x), atol=1e-6)


def test_a_process_cluster_writes_the_output_with_to_zarr(tmp_path):
    """The graph a notebook builds: ``from_zarr``, ``infer_dask``, ``to_zarr`` on a local
    ``dask.distributed`` cluster of two worker processes; the network and plan enter the graph
    once each, and the zarr array equals ``infer``."""
    distributed = pytest.importorskip("distributed")
    net = _unet(tmp_path, valid=True)
    shape = tuple(net.geometry.n_min[a] + 3 * net.grid[a] for a in range(3))
    x = np.random.default_rng(4).standard_normal((1,) + shape).astype(np.float32)
    da.from_array(x, chunks=(1, 4, 16, 16)).to_zarr(str(tmp_path / "in.zarr"))
    y = infer_dask(net, da.from_zarr(str(tmp_path / "in.zarr")), chunks=(4, 8, 8), threads=1)
    keys = [k for k in dict(y.__dask_graph__()) if isinstance(k, str) and k.startswith("znni-")]
    assert sorted(k.split("-")[1] for k in keys) == ["network", "plan"]
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None) as cluster:
        with distributed.Client(cluster):
            y.to_zarr(str(tmp_path / "out.zarr"))
    got = da.from_zarr(str(tmp_path / "out.zarr")).compute(scheduler="sync")
    np.testing.assert_allclose(got, znni_core.infer(net, x), **ROUNDING)
