"""``python -m benchmarks.read_input``: reading a task's input box, znni's reader against cloud-volume.

A uint8 EM-like volume written as precomputed layers by tensorstore (an independent writer):
raw chunks, gzip chunks, and shards (identity hash, gzip minishard indices). Per layer, one box
the size of a task's read (chunk-unaligned, crossing chunk and shard borders) is read by znni
(``PrecomputedLayer.read``: chunk objects or shard byte ranges through the layer's store) and
by cloud-volume (``CloudVolume(parallel=1)``), alternately, with a pause before each timed call;
medians of ``--rounds``. Both results must be equal.

    python -m benchmarks.read_input --shape 64,1024,1024 --box 40,600,600 --rounds 7
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np


def _write(path: Path, vol: np.ndarray, chunk, **scale) -> str:
    import tensorstore as ts

    z, y, x = vol.shape
    t = ts.open(
        {
            "driver": "neuroglancer_precomputed",
            "kvstore": f"file://{path}",
            "multiscale_metadata": {"type": "image", "data_type": "uint8", "num_channels": 1},
            "scale_metadata": {
                "size": [x, y, z],
                "chunk_size": list(chunk[::-1]),
                "resolution": [4, 4, 40],
                "encoding": "raw",
                **scale,
            },
            "create": True,
        }
    ).result()
    t[:, :, :, 0].write(vol.transpose(2, 1, 0)).result()
    return f"file://{path}"


def main(argv=None) -> dict:
    """Run the comparison; print and return the medians."""
    from cloudvolume import CloudVolume

    from znni_core.geometry import Roi
    from znni_core.io import PrecomputedLayer, parse_layer_url

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="64,512,512", help="volume z,y,x")
    ap.add_argument("--chunk", default="16,128,128", help="chunk z,y,x")
    ap.add_argument("--box", default="40,300,300", help="the box read, z,y,x")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--pause", type=float, default=0.2, help="seconds before each timed call")
    args = ap.parse_args(argv)
    shape, chunk, box = (tuple(int(v) for v in a.split(",")) for a in (args.shape, args.chunk, args.box))
    rng = np.random.default_rng(0)
    vol = rng.integers(0, 256, shape, dtype=np.uint8)
    sharding = {
        "@type": "neuroglancer_uint64_sharded_v1",
        "hash": "identity",
        "preshift_bits": 3,
        "minishard_bits": 0,
        "shard_bits": 6,
        "minishard_index_encoding": "gzip",
        "data_encoding": "gzip",
    }
    begin = tuple((n - b) // 3 for n, b in zip(shape, box))
    roi = Roi(begin, box)
    rows = {}
    with tempfile.TemporaryDirectory() as d:
        layers = {
            "raw": _write(Path(d) / "raw", vol, chunk),
            "sharded": _write(Path(d) / "sharded", vol, chunk, sharding=sharding),
        }
        for name, url in layers.items():
            times = {"znni": [], "cloud-volume": []}
            want = vol[roi.to_slices()]
            for _ in range(args.rounds):
                for who in times:
                    time.sleep(args.pause)
                    t0 = time.perf_counter()
                    if who == "znni":
                        got = PrecomputedLayer(parse_layer_url(url), 0).read(roi)[0][0]
                    else:
                        cv = CloudVolume(url, parallel=1, progress=False, cache=False)
                        (bz, by, bx), (ez, ey, ex) = roi.begin, roi.end
                        got = np.asarray(cv[bx:ex, by:ey, bz:ez])[..., 0].transpose(2, 1, 0)
                    times[who].append(time.perf_counter() - t0)
                    assert np.array_equal(got, want), f"{who} read {name} wrongly"
            med = {k: statistics.median(v) for k, v in times.items()}
            rows[name] = {
                **{f"{k}_s": round(v, 4) for k, v in med.items()},
                "ratio": round(med["cloud-volume"] / med["znni"], 2),
            }
            print(
                f"{name:8s} znni {med['znni']:.3f} s, cloud-volume {med['cloud-volume']:.3f} s, "
                f"cloud-volume/znni {rows[name]['ratio']:.2f}x",
                flush=True,
            )
    doc = {"shape": shape, "chunk": chunk, "box": box, "rounds": args.rounds, "layers": rows}
    print(json.dumps(doc))
    return doc


if __name__ == "__main__":
    main()
