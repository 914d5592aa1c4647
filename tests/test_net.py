"""Network loading: ONNX from torch.onnx.export(dynamo=False), YAML + safetensors/npz, refusals."""

from __future__ import annotations

import pickle
import warnings

import numpy as np
import pytest

import znni_core
from znni_core.errors import NetworkError, UnsupportedOperatorError
from znni_core.net import load_network, save_network
from znni_core.net.chain import Conv

from .nets import NETS, make_net
from .reference import max_rel_err, torch_dense

torch = pytest.importorskip("torch")
nn = torch.nn


def export(model, path, c_in=1, shape=(12, 12, 12)):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model.eval(), torch.zeros((1, c_in) + shape), str(path), dynamo=False)
    return path


def test_onnx_chain_matches_torch_model(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv3d(2, 4, (1, 3, 2)),
        nn.ELU(0.5),
        nn.MaxPool3d((1, 2, 2)),
        nn.Dropout(0.3),
        nn.Conv3d(4, 3, (2, 3, 3), bias=False),
        nn.LeakyReLU(0.2),
        nn.Identity(),
        nn.MaxPool3d((2, 1, 2)),
        nn.Conv3d(3, 3, 2),
        nn.Tanh(),
        nn.Conv3d(3, 2, 1),
        nn.Softmax(dim=1),
    )
    net = load_network(export(model, tmp_path / "m.onnx", c_in=2, shape=(10, 20, 20)))
    assert net.in_channels == 2 and net.out_channels == 2
    assert net.field_of_view == (1 + 0 + 0 + 1 + 1 + 1 * 2, 1 + 2 + 1 + 4 + 0 + 2, 1 + 1 + 1 + 4 + 2 + 4)
    x = np.random.default_rng(0).standard_normal((2, 7, 19, 22)).astype(np.float32)
    out = znni_core.infer(net, x)
    # one window through the original torch model == one output voxel
    f = net.field_of_view
    with torch.no_grad():
        for p in [(0, 0, 0), (1, 5, 7), tuple(s - 1 for s in out.shape[1:])]:
            win = torch.from_numpy(x[:, p[0] : p[0] + f[0], p[1] : p[1] + f[1], p[2] : p[2] + f[2]][None].copy())
            ref = model(win).numpy()[0, :, 0, 0, 0]
            assert max_rel_err(out[(slice(None),) + p], ref) <= 1e-4
    assert max_rel_err(out, torch_dense(net, x)) <= 1e-4


def test_yaml_round_trip_safetensors_and_npz(tmp_path):
    net = make_net(NETS["aniso"], c_in=2)
    path = save_network(net, tmp_path / "n.yaml")
    again = load_network(path)
    assert again.digest() == net.digest()
    # npz weights work too
    import yaml

    spec = yaml.safe_load(path.read_text())
    arrays = {}
    for i, layer in enumerate(net.layers):
        if isinstance(layer, Conv):
            arrays[f"l{i}.weight"] = layer.weight
            if layer.bias is not None:
                arrays[f"l{i}.bias"] = layer.bias
    np.savez(tmp_path / "w.npz", **arrays)
    spec["weights"] = "w.npz"
    (tmp_path / "n2.yaml").write_text(yaml.safe_dump(spec))
    assert load_network(tmp_path / "n2.yaml").digest() == net.digest()


@pytest.mark.parametrize(
    "module,match",
    [
        (nn.Conv3d(1, 2, 3, dilation=2), "dilations"),
        (nn.Sequential(nn.Conv3d(1, 2, 3), nn.MaxPool3d(2, stride=1)), "stride"),
        (nn.Sequential(nn.Conv3d(1, 4, 3), nn.Conv3d(4, 4, 3, groups=2)), "group"),
        (nn.Sequential(nn.Conv3d(1, 2, 3), nn.Hardswish()), "HardSwish"),
    ],
)
def test_unsupported_onnx_is_refused_naming_the_node(tmp_path, module, match):
    with pytest.raises(UnsupportedOperatorError, match=match) as err:
        load_network(export(module, tmp_path / "bad.onnx"))
    assert "node" in str(err.value)


@pytest.mark.parametrize(
    "module,kind",
    [
        (nn.Conv3d(1, 2, 3, padding=1), "padded"),
        (nn.Sequential(nn.Conv3d(1, 2, 3), nn.AvgPool3d(2), nn.Conv3d(2, 2, 1), nn.Upsample(scale_factor=2)), "valid"),
    ],
)
def test_what_a_chain_cannot_run_loads_as_a_graph(tmp_path, module, kind):
    from znni_core.net.graph import Graph

    net = load_network(export(module, tmp_path / "g.onnx"))
    assert isinstance(net, Graph) and net.kind == kind


def test_non_finite_weights_refused_at_load(tmp_path):
    model = nn.Conv3d(1, 2, 3)
    with torch.no_grad():
        model.weight[0, 0, 1, 1, 1] = float("nan")
    with pytest.raises(NetworkError, match="NaN/Inf"):
        load_network(export(model, tmp_path / "nan.onnx"))
    net = make_net(NETS["nopool"])
    path = save_network(net, tmp_path / "n.yaml")
    from safetensors.numpy import load_file, save_file

    t = load_file(str(tmp_path / "n.safetensors"))
    t["l0.weight"][0, 0, 0, 0, 0] = np.inf
    save_file(t, str(tmp_path / "n.safetensors"))
    with pytest.raises(NetworkError, match="NaN/Inf"):
        load_network(path)


class Boom:
    def __reduce__(self):
        return (print, ("pwned",))


@pytest.mark.parametrize("name", ["ckpt.pt", "model.pth", "weights.pkl", "sneaky.onnx"])
def test_pickle_checkpoints_are_refused(tmp_path, name, capsys):
    path = tmp_path / name
    path.write_bytes(pickle.dumps({"w": Boom()}))
    with pytest.raises(NetworkError):
        load_network(path)
    assert "pwned" not in capsys.readouterr().out


def test_yaml_tags_are_refused(tmp_path):
    path = tmp_path / "evil.yaml"
    path.write_text("format: znni-network/1\nlayers: !!python/object/apply:os.system ['echo pwned']\n")
    with pytest.raises(NetworkError, match="safe"):
        load_network(path)


def test_channel_mismatch_inside_spec_is_refused():
    with pytest.raises(NetworkError, match="input channels"):
        make_net([("conv", 2, 3), ("conv", 2, 3)]).layers  # fine
        from znni_core.net import Network

        Network((Conv(np.ones((2, 1, 3, 3, 3), np.float32)), Conv(np.ones((2, 3, 3, 3, 3), np.float32))))


# ---- one geometry for chains and graphs ------------------------------------------------------


def _as_graph(net, then_identity: bool = True):
    """The pooling-free chain ``net`` as graph nodes of the same operators; ``then_identity``: an
    identity affine node after them, so that the nodes no longer form a chain and the graph
    planner and executor run them."""
    from znni_core.net import ops
    from znni_core.net.chain import Activation
    from znni_core.net.graph import Graph, Node

    nodes, current = [], "x"
    for i, layer in enumerate(net.layers):
        if isinstance(layer, Conv):
            nodes.append(Node(ops.Convolution(layer), (current,), f"t{i}", f"n{i}"))
        else:
            assert isinstance(layer, Activation)
            nodes.append(Node(ops.Act(layer), (current,), f"t{i}", f"n{i}"))
        current = f"t{i}"
    if then_identity:
        c = net.out_channels
        identity = ops.Affine(np.ones(c, np.float32), np.zeros(c, np.float32))
        nodes.append(Node(identity, (current,), "y", "identity"))
        current = "y"
    return Graph(tuple(nodes), "x", current, net.in_channels)


@pytest.mark.parametrize("name", sorted(NETS))
def test_chain_geometry_is_the_graph_geometry_of_its_operators(name):
    """A chain's geometry is the one description graphs use: its field of view by the
    textbook formula, a centred halo, every input of at least F admissible.  Without pooling
    the same operators loaded as a graph give the very same :class:`NetGeometry`."""
    from znni_core.geometry import Halo
    from znni_core.net import AnyNetwork

    net = make_net(NETS[name])
    f, d = np.ones(3, int), np.ones(3, int)
    for layer in net.layers:
        k = getattr(layer, "kernel", None) or getattr(layer, "window", None)
        if k is not None:
            f += (np.array(k) - 1) * d
            if not hasattr(layer, "kernel"):
                d *= np.array(k)
    assert net.field_of_view == tuple(f) and net.pooling_product == tuple(d)
    h = Halo.from_field_of_view(tuple(f))
    assert net.halo == (tuple(h.low), tuple(h.high)) and net.kind == "chain"
    assert isinstance(net, AnyNetwork)
    assert net.is_admissible(tuple(f)) and not net.is_admissible(tuple(f - 1))
    assert net.floor_admissible(tuple(f - 1)) == (0, 0, 0) and net.ceil_admissible((1, 1, 1)) == tuple(f)
    flat = make_net([item for item in NETS[name] if item[0] != "pool"])
    graph = _as_graph(flat)
    assert isinstance(graph, AnyNetwork) and graph.kind == "valid"
    assert graph.geometry == flat.geometry
    line = _as_graph(flat, then_identity=False)  # a chain is a graph whose nodes form a line
    assert line.kind == "chain" and line.digest() == flat.digest() and line.geometry == flat.geometry
    assert line.layers == flat.layers and isinstance(net.nodes, tuple)


def test_one_tiler_covers_a_chain_and_a_graph_the_same_way():
    """``exec.tiling.window`` cuts a chain's output into tiles of the plan's output (a multiple
    of the pooling product, the last shifted back) and a pooling-free chain loaded as a graph
    the same way; ``run_tiled`` gives the same output under the chain's plan (its own search) and the
    graph's, equal to PyTorch."""
    from znni_core.exec.executor import Executor
    from znni_core.exec.tiling import window
    from znni_core.plan import autotune

    net = make_net([("conv", 3, 3), ("act", "relu"), ("conv", 2, (1, 3, 3)), ("act", "sigmoid")])
    graph = _as_graph(net)
    x = np.random.default_rng(1).standard_normal((1, 13, 29, 31), dtype=np.float32)
    patch = (9, 12, 12)
    chain_plan = autotune(net, patch_shape=patch, memory_budget=1 << 30, use_cache=False)
    graph_plan = autotune(graph, patch_shape=patch, memory_budget=1 << 30, use_cache=False)
    out = net.output_shape(x.shape[1:])
    wc, wg = window(net, chain_plan, (0, 0, 0), out), window(graph, graph_plan, (0, 0, 0), out)
    assert wc.tile == wg.tile == net.output_shape(patch) and wc.starts == wg.starts
    assert wc.starts == ((0, 4), (0, 8, 16, 17), (0, 8, 16, 19)) and wc.count == 32
    seen = []
    with Executor(chain_plan, net) as run:
        yc = run.volume(x, progress=seen.append)
    with Executor(graph_plan, graph) as run:
        yg = run.volume(x)
    assert len(seen) == wc.count
    ref = torch_dense(net, x)
    assert max_rel_err(yc, ref) < 1e-5 and max_rel_err(yg, ref) < 1e-5


def test_a_line_of_nodes_is_the_chain_of_its_layers_whatever_built_it(tmp_path):
    """One network form: graph nodes that form a line of convolutions, max-pooling and
    activations are a chain (dense through max-pooling fragments), with the very digest,
    geometry and description of :func:`Network` of the same layers; written as graph nodes in a
    YAML spec it loads as that chain, and it runs to PyTorch's dense output.  A graph that is not
    a line has no layers to give."""
    from znni_core.net import Network
    from znni_core.net.graph import Graph, Node

    net = make_net(NETS["iso2pool"])
    nodes, current = [], "in"
    for i, node in enumerate(net.nodes):
        nodes.append(Node(node.op, (current,), f"x{i}", node.name))
        current = f"x{i}"
    graph = Graph(tuple(nodes), "in", current, net.in_channels, name="from-nodes")
    assert graph.kind == "chain" and graph.digest() == net.digest()
    assert isinstance(graph, Network) and isinstance(net, Graph) and type(net) is Graph
    assert graph.geometry == net.geometry and graph.pooling_product == net.pooling_product != (1, 1, 1)
    assert graph.describe() == net.describe() and graph.layers == net.layers

    spec = tmp_path / "nodes.yaml"
    save_network(graph, spec)
    again = load_network(spec)
    assert again.kind == "chain" and again.digest() == net.digest()

    x = np.random.default_rng(3).standard_normal((1,) + tuple(f + 5 for f in net.field_of_view), dtype=np.float32)
    y = znni_core.infer(again, x, memory_budget=1 << 30)
    assert max_rel_err(y, torch_dense(net, x)) < 1e-5

    unet = _as_graph(make_net([("conv", 2, 3), ("act", "relu")]))
    assert unet.kind == "valid" and not isinstance(unet, Network)
    with pytest.raises(NetworkError, match="not a chain"):
        _ = unet.layers
