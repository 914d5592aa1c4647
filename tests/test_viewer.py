"""The report's link, opened in a real headless Chromium against ``znni serve``: the bundled
Neuroglancer client loads with no internet, fetches both layers through the server (no
4xx/5xx), and renders the output layer (red, by the link's shader) over the input.

Needs the ``playwright`` package (dev extra) and a Chromium binary: ``.ci/run`` installs
Debian's ``chromium-headless-shell``; elsewhere set ``ZNNI_CHROMIUM`` or install one."""

from __future__ import annotations

import os
import re
import shutil
import time

import numpy as np
import pytest

from znni_core.pipeline.finalize import neuroglancer_link
from znni_core.pipeline.run import EXAMPLE, Run
from znni_core.pipeline.serve import LayerServer

CHROMIUM = os.environ.get("ZNNI_CHROMIUM") or next(
    (p for p in map(shutil.which, ("chromium-headless-shell", "chromium", "google-chrome")) if p), None
)
playwright = pytest.importorskip("playwright.sync_api", reason="pip install playwright (dev extra)")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no Chromium: apt-get install chromium-headless-shell")


def write_layers(d, kind: str):
    """An EM-like input (uint8, smooth) and an output of diagonal stripes (float32 0/1): a file
    per chunk (``chunks``), or written by znni's shard writer, as sharded precomputed
    (``sharded``) or as an OME-Zarr v3 group (``zarr``): Neuroglancer then reads byte ranges."""
    from cloudvolume import CloudVolume

    from znni_core.geometry import Coordinate, Roi
    from znni_core.io import ScaleSpec, create_layer, open_output, parse_layer_url
    from znni_core.io.zarr_output import zarr_sharding

    x, y, z = np.meshgrid(np.arange(64), np.arange(64), np.arange(8), indexing="ij")
    em = ((np.sin(x / 5) + np.cos(y / 7) + 2) * 60).astype(np.uint8)
    info = CloudVolume.create_new_info(
        1, "image", "uint8", "raw", [4, 4, 40], [0, 0, 0], em.shape, chunk_size=[32, 32, 8]
    )
    cv = CloudVolume(f"file://{d}/em", info=info, progress=False)
    cv.commit_info()
    cv[:, :, :] = em
    out = ((x + y) % 32 < 16).astype(np.float32).T[None]  # (c, z, y, x)
    sharding = {
        "@type": "neuroglancer_uint64_sharded_v1",
        "preshift_bits": 1,
        "hash": "identity",
        "minishard_bits": 1,
        "shard_bits": 0,
        "minishard_index_encoding": "gzip",
        "data_encoding": "gzip",
    }
    name = "out.zarr" if kind == "zarr" else "out"
    url = parse_layer_url(f"file://{d}/{name}")
    key = "0" if kind == "zarr" else "4_4_40"
    sh = {"chunks": None, "sharded": sharding, "zarr": zarr_sharding((1, 2, 2), "none")}[kind]
    spec = ScaleSpec(
        key, Roi((0, 0, 0), (8, 64, 64)), Coordinate(8, 32, 32), (40.0, 4.0, 4.0), "float32", 1, sharding=sh
    )
    create_layer(url, spec, {"processing": []})
    layer = open_output(url, spec)
    chunks = {
        i: np.ascontiguousarray(out[(slice(None),) + layer.grid.chunk_roi(i).to_slices()])
        for i in layer.grid.chunks_in(layer.bounds)
    }
    if sh:
        layer.write_shard(chunks)
    else:
        for i, a in chunks.items():
            layer.write_chunk(i, a)
    return {"input": d / "em", "output": d / name}


@pytest.mark.parametrize("kind", ["chunks", "sharded", "zarr"])
def test_report_link_renders_the_output_in_a_headless_browser(tmp_path, kind):
    layers = write_layers(tmp_path, kind)
    sharded = kind != "chunks"
    logs = []
    need = 2 if sharded else 4  # the shard's index, then byte ranges of it; or 4 chunk files
    data = "/layers/output/0/c/" if kind == "zarr" else "/layers/output/4_4_40/"
    out_url = f"zarr://file://{layers['output']}" if kind == "zarr" else f"file://{layers['output']}"
    with LayerServer(layers, port=0, log=logs.append) as srv:
        run = Run.from_json(
            EXAMPLE
            | {
                "work_dir": str(tmp_path),
                "region": {"offset": [0, 0, 0], "shape": [8, 64, 64]},
                "input": EXAMPLE["input"] | {"url": f"file://{layers['input']}", "resolution": [40, 4, 4]},
                "output": EXAMPLE["output"] | {"url": out_url},
            },
            "test",
        )
        link, _ = neuroglancer_link(run, "local", srv.port)
        with playwright.sync_playwright() as p:
            browser = p.chromium.launch(
                executable_path=CHROMIUM,
                args=["--no-sandbox", "--use-angle=swiftshader", "--enable-unsafe-swiftshader"],
            )
            page = browser.new_page(viewport={"width": 800, "height": 600})
            page.goto(link)
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and sum(data in line for line in logs) < need:
                time.sleep(0.2)
            time.sleep(2)  # let it draw what it fetched
            png = tmp_path / "shot.png"
            page.screenshot(path=str(png))
            browser.close()
    fetched = [line for line in logs if "/layers/" in line]
    assert sum("/layers/input/4_4_40/" in line for line in fetched) >= 4, "\n".join(logs)
    assert sum(data in line for line in fetched) >= need, "\n".join(logs)
    assert not sharded or any(data in line and '" 206' in line for line in fetched), "\n".join(logs)
    errors = [line for line in logs if re.search(r'" [45]\d\d ', line)]
    assert not errors, errors
    from PIL import Image

    rgb = np.asarray(Image.open(png).convert("RGB")).astype(int)
    red = (rgb[..., 0] - rgb[..., 1] > 60) & (rgb[..., 0] > 120)  # only the output layer's shader draws red
    dark = rgb.max(-1) < 40  # output 0: the input shows through at 40% dimmed
    assert red.mean() > 0.01 and dark.mean() > 0.005, (red.mean(), dark.mean())


def test_the_run_report_opens_in_a_headless_browser(tmp_path):
    """``report.html`` of a finished run, opened from disk in Chromium: every figure loads (a
    non-zero natural width), the plan per layer and the verification rows are there."""
    from tests.pipeline_helpers import base_config
    from tests.test_pipeline import prepare, run_all
    from znni_core.pipeline.finalize import finalize

    rf = prepare(base_config(tmp_path))
    run_all(rf)
    s = finalize(rf, log=lambda *a: None)
    page_file = os.path.join(os.path.dirname(s["preview"]), "report.html")
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            page = browser.new_page()
            page.goto("file://" + page_file)
            page.wait_for_load_state("load")
            widths = page.eval_on_selector_all("img", "imgs => imgs.map(i => [i.getAttribute('src'), i.naturalWidth])")
            text = page.inner_text("body")
        finally:
            browser.close()
    assert len(widths) == 1 + len(s["figures"]) and all(w > 0 for _, w in widths), widths
    assert "recomputed_voxels" in text and "primitive" in text, text[:2000]
