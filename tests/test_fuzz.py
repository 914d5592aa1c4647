"""Bad input, generated (hypothesis): configs, precomputed ``info`` files (NaN and Infinity inside
their lists too), zarr attributes, network specs (a graph's deconv and affine arrays holding NaN
or Infinity too), ``plan.json`` files and the pipeline CLI's arguments (directories, unreadable
or mistyped files, bad ``--chunk`` values) with wrong, huge, negative, NaN, missing or mistyped
values.

Each must either be accepted or refused with a :class:`~znni_core.errors.ZnniError` (the CLI's
clear error, exit 2) whose message names the offending key or value; any other exception is a
traceback in the CLI and fails the test.  Nothing may be written to the output layer.  Each test
prints how many cases it ran and how many were refused (``pytest -s``).
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import numpy as np
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from znni_core.errors import ZnniError

BAD_VALUES = [
    None,
    True,
    -1,
    0,
    2**63,
    10**400,
    float("nan"),
    float("inf"),
    -1e300,
    "",
    "x",
    "1e400",
    "../../etc",
    "s3://",
    [],
    [1],
    [-1, 0, 10**12],
    [1.5, "a", None],
    {},
    {"a": 1},
    "a" * 5000,
]
SETTINGS = settings(
    max_examples=60, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck), database=None
)


def _paths(obj, prefix=()):
    """Every key path of a nested dict (leaves and inner objects)."""
    out = []
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.append(prefix + (k,))
            out += _paths(v, prefix + (k,))
    return out


def _mutate(obj, path, value, delete=False):
    """A deep copy of ``obj`` with ``path`` set to ``value`` (or deleted)."""
    obj = copy.deepcopy(obj)
    d = obj
    for k in path[:-1]:
        d = d[k]
    if delete:
        if isinstance(d, dict):
            d.pop(path[-1], None)
    else:
        d[path[-1]] = value
    return obj


def _named(msg: str, path, value) -> bool:
    """Whether an error message names the key (its dotted path or last part) or the value."""
    texts = {".".join(map(str, path)), str(path[-1])}
    if value is not None and not isinstance(value, (dict, list, bool)):
        texts.add(str(value)[:40])
    return any(t and t in msg for t in texts)


class Tally:
    """Cases run and refused, printed at the end of a test."""

    def __init__(self, what):
        self.what, self.ran, self.refused = what, 0, 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        print(f"\n{self.what}: {self.ran} cases, {self.refused} refused with a clear error")
        return False


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    from znni_core.pipeline.demo import write_demo, write_demo_config

    d = tmp_path_factory.mktemp("fuzz")
    write_demo(d / "data", shape=(16, 64, 64), chunk=(8, 32, 32))
    write_demo_config(
        d / "c.yaml",
        d / "data",
        work_dir=d / "work",
        output=f"file://{d}/out",
        task_chunks=(1, 2, 2),
        chunk=(8, 32, 32),
    )
    return d, yaml.safe_load((d / "c.yaml").read_text())


CONFIG_KEYS = st.sampled_from(
    [
        ("input", "mip"),
        ("input", "dtype"),
        ("input", "resolution"),
        ("input", "missing"),
        ("input", "endpoint_url"),
        ("normalize", "scale"),
        ("normalize", "shift"),
        ("output", "dtype"),
        ("output", "chunk_size"),
        ("output", "encoding"),
        ("output", "compression"),
        ("output", "sharding"),
        ("output", "shard_bytes"),
        ("output", "scale_key"),
        ("task_chunks",),
        ("edge",),
        ("region",),
        ("downsample", "mips"),
        ("downsample", "factor"),
        ("jobs", "tasks_per_job"),
        ("jobs", "minutes"),
        ("jobs", "max_jobs"),
        ("jobs", "voxels_per_second"),
        ("device",),
        ("plan", "effort"),
        ("plan", "memory_fraction"),
        ("plan", "gpu_memory"),
        ("blend", "overlap"),
        ("blend", "patch_shape"),
        ("finalize", "serve_port"),
        ("network", "resolution"),
    ]
)


def test_fuzzed_configs_are_accepted_or_refused_clearly(demo):
    from znni_core.pipeline.resolve import resolve

    d, base = demo
    with Tally("configs") as tally:

        @SETTINGS
        @given(path=CONFIG_KEYS, value=st.sampled_from(BAD_VALUES), delete=st.booleans())
        def case(path, value, delete):
            cfg = _mutate(base, path, value, delete=delete)
            tally.ran += 1
            non_finite = isinstance(value, float) and not math.isfinite(value) and not delete
            try:
                resolve(cfg, progress=lambda *a: None)
                assert not non_finite, f"{path}={value!r} accepted"
            except ZnniError as exc:
                tally.refused += 1
                msg = str(exc)
                assert msg.strip(), (path, value)
                assert delete or _named(msg, path, value), f"{path}={value!r}: the message names neither: {msg}"
            assert not (d / "out").exists(), "resolve wrote the output layer"

        case()
        assert tally.refused > tally.ran // 3


def _info(d):
    return json.loads((d / "data" / "em" / "info").read_text())


def test_fuzzed_info_files_are_accepted_or_refused_clearly(demo, tmp_path):
    from znni_core.io import PrecomputedLayer, parse_layer_url

    d, _ = demo
    base = _info(d)
    layer = tmp_path / "em"
    layer.mkdir()
    url = parse_layer_url(f"file://{layer}", what="input")
    keys = [p for p in _paths(base) if p[0] != "scales"] + [
        ("scales", 0, k) for k in ("chunk_sizes", "encoding", "key", "resolution", "size", "voxel_offset")
    ]
    with Tally("info files") as tally:

        @SETTINGS
        @given(path=st.sampled_from(keys), value=st.sampled_from(BAD_VALUES), delete=st.booleans())
        def case(path, value, delete):
            info = _mutate(base, path, value, delete=delete)
            (layer / "info").write_text(json.dumps(info))  # NaN and Infinity as Python's json writes them
            tally.ran += 1
            try:
                lay = PrecomputedLayer(url)
                lay.bounds, lay.grid, lay.dtype  # noqa: B018 (the geometry must be usable)
            except ZnniError as exc:
                tally.refused += 1
                assert delete or _named(str(exc), path, value), f"{path}={value!r}: {exc}"

        case()
        assert tally.refused > tally.ran // 3


def test_fuzzed_sharding_specs_are_accepted_or_refused_clearly(demo, tmp_path):
    """An input's sharding spec with wrong, huge, negative or mistyped values (or a key missing):
    refused when the layer opens, naming the key; an accepted one reads (its shards absent here:
    every chunk named missing, or filled when asked), never a traceback."""
    from znni_core.errors import DataError
    from znni_core.io import PrecomputedLayer, parse_layer_url

    d, _ = demo
    base = _info(d)
    base["scales"][0]["sharding"] = {
        "@type": "neuroglancer_uint64_sharded_v1",
        "hash": "identity",
        "preshift_bits": 1,
        "minishard_bits": 1,
        "shard_bits": 4,
        "minishard_index_encoding": "gzip",
        "data_encoding": "raw",
    }
    layer = tmp_path / "em"
    layer.mkdir()
    url = parse_layer_url(f"file://{layer}", what="input")
    keys = [("scales", 0, "sharding")] + [("scales", 0, "sharding", k) for k in base["scales"][0]["sharding"]]
    with Tally("sharding specs") as tally:

        @SETTINGS
        @given(path=st.sampled_from(keys), value=st.sampled_from(BAD_VALUES), delete=st.booleans())
        def case(path, value, delete):
            (layer / "info").write_text(json.dumps(_mutate(base, path, value, delete=delete)))
            tally.ran += 1
            try:
                lay = PrecomputedLayer(url)
            except ZnniError as exc:
                tally.refused += 1
                assert _named(str(exc), path, value) or "sharding" in str(exc), f"{path}={value!r}: {exc}"
                return
            with pytest.raises(DataError, match="missing"):
                lay.read(lay.bounds)
            lay.read(lay.bounds, fill_missing=True)

        case()
        assert tally.refused > tally.ran // 3


def test_fuzzed_zarr_attributes_are_accepted_or_refused_clearly(tmp_path):
    import zarr

    from znni_core.io import ZarrLayer, parse_layer_url

    path = tmp_path / "in.zarr"
    arr = zarr.create_array(str(path), shape=(8, 16, 16), chunks=(4, 8, 8), dtype="uint8", zarr_format=3)
    arr[...] = 7
    arr.attrs.update({"resolution": [40.0, 4.0, 4.0], "voxel_offset": [0, 0, 0]})
    meta_path = path / "zarr.json"
    base = json.loads(meta_path.read_text())
    url = parse_layer_url(f"file://{path}", what="input")
    with Tally("zarr attributes") as tally:

        @SETTINGS
        @given(key=st.sampled_from(["resolution", "voxel_offset"]), value=st.sampled_from(BAD_VALUES))
        def case(key, value):
            meta = copy.deepcopy(base)
            meta.setdefault("attributes", {})[key] = value
            meta_path.write_text(json.dumps(meta))
            tally.ran += 1
            try:
                layer = ZarrLayer(url)
                layer.bounds, layer.resolution  # noqa: B018
                if not (isinstance(value, list) and len(value) == 3):
                    raise AssertionError(f"{key}={value!r} accepted")
            except ZnniError as exc:
                tally.refused += 1
                assert key in str(exc), f"{key}={value!r}: {exc}"

        case()
        assert tally.refused > tally.ran // 2


def test_fuzzed_network_specs_are_accepted_or_refused_clearly(demo, tmp_path):
    import shutil

    from znni_core import load_network

    d, _ = demo
    shutil.copy(d / "data" / "net.safetensors", tmp_path / "net.safetensors")
    base = yaml.safe_load((d / "data" / "net.yaml").read_text())
    keys = [("format",), ("name",), ("weights",), ("layers",)] + [
        ("layers", i, k) for i, layer in enumerate(base["layers"]) for k in layer
    ]
    with Tally("network specs") as tally:

        @SETTINGS
        @given(path=st.sampled_from(keys), value=st.sampled_from(BAD_VALUES), delete=st.booleans())
        def case(path, value, delete):
            spec = _mutate(base, path, value, delete=delete)
            f = tmp_path / "net.yaml"
            f.write_text(yaml.safe_dump(spec))
            tally.ran += 1
            try:
                net = load_network(f)
                assert all(math.isfinite(float(np.abs(l.weight).max())) for l in net.layers if hasattr(l, "weight"))
            except ZnniError as exc:
                tally.refused += 1
                assert str(exc).strip()

        case()
        assert tally.refused > tally.ran // 3


def test_fuzzed_network_files_are_refused_clearly(tmp_path):
    """Truncated, empty and random bytes as an ONNX file or a YAML spec."""
    from znni_core import load_network

    rng = np.random.default_rng(0)
    ran = 0
    for suffix in (".onnx", ".yaml"):
        for data in (b"", b"\x00" * 10, rng.bytes(200), b"ir_version: 7\n", b"- [a, b\n", b"format: znni-network/1\n"):
            f = tmp_path / f"net{ran}{suffix}"
            f.write_bytes(data)
            ran += 1
            with pytest.raises(ZnniError) as err:
                load_network(f)
            assert f.name in str(err.value) or "network" in str(err.value).lower(), err.value
    print(f"\nnetwork files: {ran} cases, {ran} refused with a clear error")


def test_the_cli_refuses_a_fuzzed_config_with_exit_2_and_no_traceback(demo, tmp_path):
    """Through the real CLI: a bad value gives exit 2, one message, no traceback."""
    import subprocess
    import sys

    d, base = demo
    for path, value in ((("normalize", "scale"), float("nan")), (("task_chunks",), [0, -1, 10**12])):
        cfg = _mutate(base, path, value)
        f = tmp_path / "bad.yaml"
        f.write_text(yaml.safe_dump(cfg))
        p = subprocess.run(
            [sys.executable, "-m", "znni_core.cli", "validate", str(f), "--dry-run"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).parent.parent,
        )
        assert p.returncode == 2, (path, p.returncode, p.stderr[-2000:])
        assert "Traceback" not in p.stderr + p.stdout, p.stderr[-2000:]
        assert _named(p.stderr + p.stdout, path, value), p.stderr[-1000:]


RUN_KEYS = st.sampled_from(
    [(k,) for k in ("config", "work_dir", "network", "input", "output", "region", "mask", "task_chunks")]
    + [(k,) for k in ("num_tasks", "num_chunks", "plan", "mem_mb", "versions", "digest", "input_checksums")]
    + [("network", k) for k in ("path", "digest", "field_of_view", "kind", "halo", "in_channels", "out_channels")]
    + [("input", k) for k in ("url", "mip", "bounds", "resolution", "dtype", "channels")]
    + [("output", k) for k in ("url", "scale", "info")]
    + [("plan", k) for k in ("path", "digest", "patch_shape", "memory_budget")]
)


def test_fuzzed_run_files_are_accepted_or_refused_clearly(tmp_path):
    """A hand-edited ``run.json`` (a key deleted, or set to a wrong, huge, NaN or mistyped value):
    loaded only when every typed part has its type, else a ConfigError naming the key."""
    from znni_core.pipeline.run import EXAMPLE, load_run

    f = tmp_path / "run.json"
    with Tally("run.json files") as tally:

        @SETTINGS
        @given(path=RUN_KEYS, value=st.sampled_from(BAD_VALUES), delete=st.booleans())
        def one(path, value, delete):
            tally.ran += 1
            f.write_text(json.dumps(_mutate(EXAMPLE, path, value, delete=delete)))
            try:
                run = load_run(f)
            except ZnniError as exc:
                tally.refused += 1
                assert _named(str(exc), path, value) and "znni validate" in str(exc), (path, value, str(exc))
                return
            node = run
            for k in path:  # accepted: the value has the declared type (or the optional key is absent)
                node = getattr(node, k)
            assert delete or node == value or (isinstance(value, float) and math.isnan(value)), (path, value)

        one()
    assert tally.refused > 0


#: values put inside an info's lists (one element at a time): JSON's NaN and Infinity as Python's
#: json writes them, integers past float's range, fractions, mistyped
ELEMENT_VALUES = [
    float("nan"),
    float("inf"),
    float("-inf"),
    10**400,
    2**63,
    1e300,
    -(2**60),
    1.5,
    0,
    -1,
    True,
    None,
    "4",
    [4],
]


def test_fuzzed_info_list_elements_are_accepted_or_refused_clearly(demo, tmp_path):
    """One element of an info's ``resolution``, ``size``, ``voxel_offset`` or ``chunk_sizes[0]``
    replaced (``resolution: [NaN, 4, 4]``, ``voxel_offset`` with Infinity, ...): refused with a
    :class:`ZnniError` naming the key, or accepted with a usable geometry; NaN and Infinity are
    always refused."""
    from znni_core.io import PrecomputedLayer, parse_layer_url

    d, _ = demo
    base = _info(d)
    layer = tmp_path / "em"
    layer.mkdir()
    url = parse_layer_url(f"file://{layer}", what="input")
    lists = [("resolution",), ("size",), ("voxel_offset",), ("chunk_sizes", 0)]
    with Tally("info list elements") as tally:

        @SETTINGS
        @given(key=st.sampled_from(lists), at=st.integers(0, 2), value=st.sampled_from(ELEMENT_VALUES))
        def case(key, at, value):
            info = copy.deepcopy(base)
            node = info["scales"][0]
            for k in key:
                node = node[k]
            node[at] = value
            (layer / "info").write_text(json.dumps(info))  # NaN, Infinity: what Python's json writes
            tally.ran += 1
            non_finite = isinstance(value, float) and not math.isfinite(value)
            try:
                lay = PrecomputedLayer(url)
                lay.bounds, lay.grid, lay.dtype, lay.resolution  # noqa: B018
                lay.grid.chunk_roi(next(iter(lay.grid.chunks_in(lay.bounds))))
                assert not non_finite, f"{key}[{at}]={value!r} accepted"
            except ZnniError as exc:
                tally.refused += 1
                assert key[0] in str(exc), f"{key}[{at}]={value!r}: {exc}"

        case()
        assert tally.refused > tally.ran // 3


@pytest.fixture(scope="module")
def demo_run(demo, tmp_path_factory):
    """A validated run of the demo (run.json, plan.json, the output layer), in its own work dir."""
    from .test_pipeline import prepare

    d, base = demo
    w = tmp_path_factory.mktemp("fuzz-run")
    cfg = _mutate(_mutate(base, ("work_dir",), str(w / "work")), ("output", "path"), f"file://{w}/out")
    return w, prepare(cfg)


def _plan_paths(plan: dict) -> list:
    fields = [(k,) for k in plan if k != "predicted_voxels_per_s"]
    return fields + [("steps", 0, k) for k in plan["steps"][0]] + [("steps", 0), ("rejected", 0)]


def test_fuzzed_plan_files_are_accepted_or_refused_clearly(demo_run, tmp_path):
    """A ``plan.json`` with a field deleted (of the plan or of a step), or set to a wrong, huge,
    NaN or mistyped value: refused with a :class:`~znni_core.errors.PlanError` naming the file and
    the field, or accepted with a usable plan (its digest and description)."""
    from znni_core.errors import PlanError
    from znni_core.pipeline.run import load_run
    from znni_core.plan.plan import Plan

    _, rf = demo_run
    base = json.loads(Path(load_run(rf).plan.path).read_text())
    f = tmp_path / "plan.json"
    with Tally("plan files") as tally:

        @SETTINGS
        @given(path=st.sampled_from(_plan_paths(base)), value=st.sampled_from(BAD_VALUES), delete=st.booleans())
        def case(path, value, delete):
            doc = copy.deepcopy(base)
            node = doc
            for k in path[:-1]:
                node = node[k]
            if delete and isinstance(node, dict):
                node.pop(path[-1], None)
            elif delete:
                node.pop(path[-1])
            else:
                node[path[-1]] = value
            f.write_text(json.dumps(doc))
            tally.ran += 1
            try:
                plan = Plan.load(f)
                plan.digest(), plan.describe()  # noqa: B018
            except ZnniError as exc:
                tally.refused += 1
                assert isinstance(exc, PlanError), (path, value, exc)
                assert str(f) in str(exc), (path, value, str(exc))
                assert delete or _named(str(exc), path, value) or str(path[0]) in str(exc), (path, value, str(exc))

        case()
        # and whole files that are no plan
        for text in ("", "[]", "{", "null", '{"format": "znni-plan/1"}', "\x00"):
            f.write_text(text)
            tally.ran += 1
            with pytest.raises(PlanError) as err:
                Plan.load(f)
            tally.refused += 1
            assert str(f) in str(err.value)
        assert tally.refused > tally.ran // 3


def _graph_spec(d: Path) -> tuple[dict, dict]:
    """A small graph network spec (conv, pool, deconv, affine) and its arrays, saved as npz in ``d``."""
    arrays = {
        "c.w": np.full((2, 1, 1, 3, 3), 1 / 9, np.float32),
        "c.b": np.zeros(2, np.float32),
        "d.w": np.ones((2, 2, 1, 2, 2), np.float32),
        "d.b": np.zeros(2, np.float32),
        "n.s": np.ones(2, np.float32),
        "n.t": np.zeros(2, np.float32),
    }
    np.savez(d / "g.npz", **arrays)
    return {
        "format": "znni-network/1",
        "name": "g",
        "weights": "g.npz",
        "input": "x",
        "in_channels": 1,
        "output": "y",
        "nodes": [
            {"op": "conv", "inputs": ["x"], "output": "a", "weight": "c.w", "bias": "c.b"},
            {"op": "pool", "inputs": ["a"], "output": "p", "kind": "max", "window": [1, 2, 2]},
            {"op": "deconv", "inputs": ["p"], "output": "e", "weight": "d.w", "bias": "d.b", "stride": [1, 2, 2]},
            {"op": "affine", "inputs": ["e"], "output": "y", "scale": "n.s", "shift": "n.t"},
        ],
    }, arrays


def _arrays(net) -> list:
    """Every parameter array of a graph network's nodes."""
    out = []
    for node in net.nodes:
        for k, v in node.op.params().items():
            if k == "conv":
                out += [v.weight] + ([v.bias] if v.bias is not None else [])
            elif isinstance(v, np.ndarray):
                out.append(v)
    return out


def test_fuzzed_graph_network_specs_are_accepted_or_refused_clearly(tmp_path):
    """A graph spec's node fields set to wrong values, and its deconv and affine arrays (and the
    conv's) holding NaN or Infinity in one element: refused with a clear error, never a network
    whose arrays are not finite."""
    from znni_core import load_network

    base, arrays = _graph_spec(tmp_path)
    keys = [("nodes", i, k) for i, node in enumerate(base["nodes"]) for k in node if k != "op"]
    f = tmp_path / "g.yaml"
    with Tally("graph network specs") as tally:

        @SETTINGS
        @given(
            path=st.sampled_from(keys),
            value=st.sampled_from(BAD_VALUES),
            mutate=st.booleans(),
            array=st.sampled_from(sorted(arrays)),
            bad=st.sampled_from([float("nan"), float("inf"), -float("inf"), 1e39]),
        )
        def case(path, value, mutate, array, bad):
            spec = _mutate(base, path, value) if mutate else copy.deepcopy(base)
            w = {k: v.astype(np.float64) for k, v in arrays.items()}
            if not mutate:
                w[array].flat[-1] = bad  # 1e39 becomes Infinity in float32
            np.savez(tmp_path / "g.npz", **w)
            f.write_text(yaml.safe_dump(spec))
            tally.ran += 1
            try:
                net = load_network(f)
                assert all(np.isfinite(a).all() for a in _arrays(net)), (path, value, array, bad)
            except ZnniError as exc:
                tally.refused += 1
                assert str(exc).strip() and (str(f) in str(exc) or "network" in str(exc).lower()), exc
                if not mutate:
                    assert "NaN/Inf" in str(exc) and (array in str(exc) or "weight or bias" in str(exc)), exc

        case()
        assert tally.refused > tally.ran // 3


CLI_CHUNKS = ["", "a", ",", "1,2", "1,2,3,4", "-1,0,0", "1.5,0,0", "1e9,0,0", "9" * 30 + ",0,0", "0-1_2-3_4-5"]
CLI_CHUNKS += ["k/", "/", "0-1_", "\x00", "0,0,0/x", "x" * 5000, "0 0 0", "٠,٠,٠"]  # noqa: RUF001 (Arabic digits)


def test_fuzzed_pipeline_cli_arguments_are_refused_in_one_line(demo_run, tmp_path):
    """The workflow commands given a directory, a missing, empty, binary or mistyped file where a
    run file or config belongs, a directory as an output file, or a bad ``--chunk``: exit 1 or 2
    with one ``error:`` line, never a traceback."""
    from typer.testing import CliRunner

    from znni_core.cli import app

    w, rf = demo_run
    (tmp_path / "dir").mkdir()
    files = {
        "run": str(rf),
        "dir": str(tmp_path / "dir"),
        "missing": str(tmp_path / "absent.json"),
        "empty": str(tmp_path / "empty.json"),
        "binary": str(tmp_path / "binary.json"),
        "list": str(tmp_path / "list.json"),
        "other": str(tmp_path / "other.json"),
        "yaml": str(tmp_path / "bad.yaml"),
    }
    Path(files["empty"]).write_bytes(b"")
    Path(files["binary"]).write_bytes(bytes(range(256)) * 4)
    Path(files["list"]).write_text("[1, 2]")
    Path(files["other"]).write_text('{"format": "znni-run/1", "config": 7}')
    Path(files["yaml"]).write_text("input: [\n")
    commands = [
        lambda r, c, o: ["tasks", r],
        lambda r, c, o: ["tasks", r, "-o", o],
        lambda r, c, o: ["status", r],
        lambda r, c, o: ["run-task", r, "--chunk", c],
        lambda r, c, o: ["run-task", r, "--task", "0", "--memory", "0"],
        lambda r, c, o: ["run-job", r, "--job", "0", "--tasks-per-job", "1", "--marker", o],
        lambda r, c, o: ["finalize", r, "--verify", c or "checksum"],
        lambda r, c, o: ["verify", r, "--tasks", "0", "--empty", "0"],
        lambda r, c, o: ["mask-tasks", r, "-o", o],
        lambda r, c, o: ["pyramid", r],
        lambda r, c, o: ["create-layer", r, "--marker", o],
        lambda r, c, o: ["validate", r, "--dry-run"] if r != files["run"] else ["status", r],
        lambda r, c, o: ["estimate", r] if r != files["run"] else ["status", r],
    ]
    outputs = [str(tmp_path / "dir"), str(tmp_path / "no" / "such" / "dir" / "x.json"), str(tmp_path / "o.json")]
    runner = CliRunner()
    with Tally("pipeline CLI arguments") as tally:

        @SETTINGS
        @given(
            command=st.sampled_from(commands),
            run=st.sampled_from(sorted(files)),
            chunk=st.sampled_from(CLI_CHUNKS),
            out=st.sampled_from(outputs),
        )
        def case(command, run, chunk, out):
            args = command(files[run], chunk, out)
            r = runner.invoke(app, args)
            tally.ran += 1
            assert r.exception is None or isinstance(r.exception, SystemExit), (args, repr(r.exception), r.output)
            assert "Traceback" not in r.output, (args, r.output[-2000:])
            if r.exit_code:
                tally.refused += 1
                assert r.exit_code in (1, 2), (args, r.exit_code, r.output[-1000:])
                errors = [line for line in r.output.splitlines() if line.startswith("error:")]
                assert len(errors) == 1 or "Usage:" in r.output, (args, r.output[-1000:])

        case()
        assert tally.refused > tally.ran // 2
