"""Networks as PyTorch exports them today (docs/models.md): each exporter (legacy ``dynamo=False``,
dynamo ``dynamo=True``) with static shapes and with dynamic axes, for a chain, padded U-Nets and a
valid U-Net, loaded by znni and run on an input of another shape than the export's, equal to
PyTorch's own output on it."""

from __future__ import annotations

import logging
import warnings

import numpy as np
import pytest

import znni_core
from znni_core.errors import NetworkError
from znni_core.net import onnx_loader

from .reference import max_rel_err

torch = pytest.importorskip("torch")
pytest.importorskip("onnx")
from .unets import CropUNet, HalfCrop, PadUNet, UNet, admissible, chain_model, export_as, run  # noqa: E402

#: as the other exactness tests: float32 PyTorch against float32 znni, relative to the output's range
RTOL = 1e-4


def _kind(name):
    """``(model, kind znni reads it as, export shape, run shape)`` for a network kind."""
    torch.manual_seed(7)
    if name == "chain":
        return chain_model(), "chain", (8, 24, 24), (9, 27, 30)
    if name == "padded":  # same-padded convolutions, transposed-convolution upsampling, concat skips
        return UNet(valid=False, depth=2, pool=(1, 2, 2), width=2, up="transpose"), "padded", (6, 16, 16), (6, 20, 24)
    if name == "padded-resize":  # the same with nn.Upsample (Resize) and addition skips
        model = UNet(valid=False, depth=2, pool=(1, 2, 2), width=2, up="nearest", merge="add")
        return model, "padded", (6, 16, 16), (7, 24, 20)
    if name == "padded-pad":  # milesial-style: F.pad to the skip's size, computed from shapes
        return PadUNet(), "padded", (6, 16, 16), (6, 20, 24)
    if name == "valid":  # unpadded convs, skips cropped with s[..., a:-a, b:-b, c:-c] computed from shapes
        model = CropUNet(depth=2, pool=(1, 2, 2), width=2)
        at = tuple(model.admissible(a, lo) for a, lo in enumerate((13, 30, 30)))
        other = tuple(model.admissible(a, lo) for a, lo in enumerate((at[0] + 1, at[1] + 5, at[2] + 9)))
        return model, "valid", at, other
    if name == "valid-crop":  # skips cropped with x[..., o:o + like.shape[i]] (tests/unets.py)
        model = UNet(valid=True, depth=2, pool=(1, 2, 2), width=2, up="transpose")
        at = tuple(admissible(model, a, lo) for a, lo in enumerate((10, 30, 30)))
        other = tuple(admissible(model, a, lo) for a, lo in enumerate((at[0] + 1, at[1] + 5, at[2] + 9)))
        return model, "valid", at, other
    raise ValueError(name)


def _export(model, path, shape, exporter, dynamic):
    if exporter == "dynamo":
        pytest.importorskip("onnxscript", reason="torch.onnx.export(dynamo=True) needs onnxscript (the dev extra)")
        logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    return export_as(model, path, shape, exporter, dynamic)


def _equals_torch(net, model, shape, seed=3):
    x = np.random.default_rng(seed).standard_normal((1,) + tuple(shape)).astype(np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = znni_core.infer(net, x)
    ref = run(model, x)
    if net.kind == "chain":  # dense output; PyTorch's is its subsampling on the pooling product
        p = net.pooling_product
        out = out[:, :: p[0], :: p[1], :: p[2]][:, : ref.shape[1], : ref.shape[2], : ref.shape[3]]
    assert max_rel_err(out, ref) <= RTOL


EXPORTS = [
    pytest.param("legacy", None, id="legacy-static"),
    pytest.param("legacy", "axes", id="legacy-dynamic_axes"),
    pytest.param("dynamo", None, id="dynamo-static"),
    pytest.param("dynamo", "shapes", id="dynamo-dynamic_shapes"),
]


def _matrix():
    for kind in ("chain", "padded", "padded-resize", "valid"):
        for p in EXPORTS + [pytest.param("dynamo", "axes", id="dynamo-dynamic_axes")]:
            exporter, dynamic = p.values
            # dynamo's dynamic exports of valid U-Nets take 10-20 s each (torch.export's symbolic shapes)
            slow = exporter == "dynamo" and dynamic is not None and (kind == "valid" or dynamic == "axes")
            yield pytest.param(exporter, dynamic, kind, id=f"{p.id}-{kind}", marks=[pytest.mark.slow] if slow else [])


@pytest.mark.parametrize("exporter,dynamic,kind", list(_matrix()))
def test_exported_network_equals_torch(tmp_path, exporter, dynamic, kind):
    """Every (exporter x static/dynamic shapes x network kind) loads as the kind it is and equals
    PyTorch on an input of another shape than the export's."""
    model, want, at, other = _kind(kind)
    path = _export(model, tmp_path / "net.onnx", at, exporter, dynamic)
    net = znni_core.load_network(path)
    assert net.kind == want
    _equals_torch(net, model, other)


@pytest.mark.parametrize(
    "exporter,dynamic,kind",
    [
        ("legacy", "axes", "padded-pad"),
        ("legacy", "batch", "valid"),
        ("legacy", "batch", "valid-crop"),
        pytest.param("dynamo", "shapes", "padded-pad"),
        pytest.param("dynamo", "shapes", "valid-crop", marks=pytest.mark.slow),
    ],
)
def test_shape_arithmetic_of_dynamic_exports_folds(tmp_path, exporter, dynamic, kind):
    """Pads and crops computed from shapes fold at load: ``F.pad`` to the skip's size (a ``Shape``
    of a computed list of pads), ``x[..., o:o + like.shape[2]]`` (dynamo's ``Shape``/``Min``/
    ``Reshape``), and a valid U-Net's crops in an export whose batch axis only is dynamic."""
    import onnx

    model, want, at, other = _kind(kind)
    path = _export(model, tmp_path / "net.onnx", at, exporter, dynamic)
    assert any(n.op_type == "Shape" for n in onnx.load(str(path)).graph.node)
    net = znni_core.load_network(path)
    assert net.kind == want
    _equals_torch(net, model, other)


def _structure(net):
    return [(n.op.label, {k: v for k, v in n.op.params().items() if isinstance(v, tuple)}) for n in net.nodes]


@pytest.mark.parametrize("depth,pool", [(3, (1, 2, 2)), (3, (2, 2, 2)), (2, (1, 3, 3))])
def test_deep_valid_unets_exported_with_dynamic_axes_load_as_their_static_export(tmp_path, depth, pool):
    """Issue 55: the shape arithmetic of a dynamic-axes export was evaluated at 64 x 320 x 320,
    where these U-Nets floor (a pooling of an odd length) or are too short, so their skip crops
    came out wrong ("inputs meet with lengths [65, 64]", "no input length up to 4096 is
    admissible").  It is now evaluated where the network runs exactly: the same graph as the
    static export of the same network."""
    torch.manual_seed(depth)
    model = CropUNet(depth=depth, pool=pool, width=1)
    at = tuple(model.admissible(a, 1) for a in range(3))
    static = znni_core.load_network(export_as(model, tmp_path / "s.onnx", at, "legacy"))
    dynamic = znni_core.load_network(export_as(model, tmp_path / "d.onnx", at, "legacy", "axes"))
    assert dynamic.kind == static.kind == "valid"
    assert dynamic.geometry == static.geometry
    assert _structure(dynamic) == _structure(static)
    if pool == (1, 2, 2):  # and it equals PyTorch on an input larger than the export's
        _equals_torch(dynamic, model, tuple(n + g for n, g in zip(at, (1, 8, 16))))


def test_a_static_export_at_an_input_where_the_network_floors_is_refused_naming_node_and_fix(tmp_path):
    """PyTorch floors a pooling of an odd length, and the skip crops it exports are then that
    input's: the file runs on no input exactly.  The refusal names the export shape, the node that
    floored and the fix; the same network exported there with dynamic axes loads."""
    model, _, at, other = _kind("valid-crop")
    odd = (at[0], at[1] + 1, at[2] + 1)
    path = export_as(model, tmp_path / "s.onnx", odd, "legacy")
    with pytest.raises(
        NetworkError, match=r"exported at input .*floors .*MaxPool.*re-export at an input every pooling divides"
    ):
        znni_core.load_network(path)
    _equals_torch(znni_core.load_network(export_as(model, tmp_path / "d.onnx", odd, "legacy", "axes")), model, other)


@pytest.mark.parametrize("exporter,dynamic", [("legacy", "axes"), ("dynamo", "shapes")])
def test_a_crop_that_depends_on_the_input_size_is_refused_naming_node_and_fix(tmp_path, exporter, dynamic):
    path = _export(HalfCrop(), tmp_path / "half.onnx", (5, 12, 12), exporter, dynamic)
    with pytest.raises(NetworkError, match=r"node '.*' .*depend on the input size.*static shapes") as err:
        znni_core.load_network(path)
    assert "\n" not in str(err.value)


def test_no_admissible_probe_is_one_line_naming_the_last_node_and_the_fix(tmp_path, monkeypatch):
    model = CropUNet(depth=3, pool=(2, 2, 2), width=1)
    at = tuple(model.admissible(a, 1) for a in range(3))
    path = export_as(model, tmp_path / "d.onnx", at, "legacy", "axes")
    monkeypatch.setattr(onnx_loader, "_MAX_PROBES", 1)
    with pytest.raises(
        NetworkError, match=r"found no input shape .*last: .*(MaxPool|Conv).*export with static shapes"
    ) as err:
        znni_core.load_network(path)
    assert "\n" not in str(err.value)


def test_dynamo_weights_in_a_missing_external_data_file_are_named(tmp_path):
    model, _, at, _ = _kind("chain")
    path = _export(model, tmp_path / "net.onnx", at, "dynamo", None)
    data = [p for p in tmp_path.iterdir() if p.name != "net.onnx"]
    if not data:
        pytest.skip("this exporter embedded the weights")
    for p in data:
        p.unlink()
    with pytest.raises(NetworkError, match=r"weights are stored in 'net\.onnx\.data' beside it.*external_data=False"):
        znni_core.load_network(path)


def test_a_valid_unet_on_an_input_whose_output_is_below_its_grid(tmp_path):
    """A deep valid U-Net (grid 8) on its smallest admissible input gives an output smaller than
    its grid: the whole input runs as one patch, equal to PyTorch; an input that would need a
    second tile there is refused in one line naming the shapes (it was an IndexError)."""
    from znni_core.errors import PlanError

    torch.manual_seed(5)
    model = CropUNet(depth=3, pool=(2, 2, 2), width=2).eval()
    net = znni_core.load_network(_export(model, tmp_path / "deep.onnx", (92, 100, 108), "legacy", None))
    assert net.grid == (8, 8, 8) and tuple(net.geometry.n_min) == (92, 92, 92)
    _equals_torch(net, model, (92, 100, 108))
    x = np.zeros((93, 100, 108), np.float32)
    with pytest.raises(PlanError, match=r"smaller than the network's grid \(8, 8, 8\).*\(92, 100, 108\)"):
        znni_core.infer(net, x)
