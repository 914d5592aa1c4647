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
from znni_core.pipeline.serve import LayerServer

CHROMIUM = os.environ.get("ZNNI_CHROMIUM") or next(
    (p for p in map(shutil.which, ("chromium-headless-shell", "chromium", "google-chrome")) if p), None)
playwright = pytest.importorskip("playwright.sync_api", reason="pip install playwright (dev extra)")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no Chromium: apt-get install chromium-headless-shell")


def write_layers(d):
    """An EM-like input (uint8, smooth) and an output of diagonal stripes (float32 0/1)."""
    from cloudvolume import CloudVolume

    x, y, z = np.meshgrid(np.arange(64), np.arange(64), np.arange(8), indexing="ij")
    data = {"em": ((np.sin(x / 5) + np.cos(y / 7) + 2) * 60).astype(np.uint8),
            "out": ((x + y) % 32 < 16).astype(np.float32)}
    for name, v in data.items():
        info = CloudVolume.create_new_info(1, "image", str(v.dtype), "raw", [4, 4, 40], [0, 0, 0], v.shape,
                                           chunk_size=[32, 32, 8])
        cv = CloudVolume(f"file://{d}/{name}", info=info, progress=False)
        cv.commit_info()
        cv[:, :, :] = v
    return {"input": d / "em", "output": d / "out"}


def test_report_link_renders_the_output_in_a_headless_browser(tmp_path):
    layers = write_layers(tmp_path)
    logs = []
    with LayerServer(layers, port=0, log=logs.append) as srv:
        run = {"work_dir": str(tmp_path), "region": {"offset": [0, 0, 0], "shape": [8, 64, 64]},
               "input": {"url": f"file://{layers['input']}", "resolution": [40, 4, 4]},
               "output": {"url": f"file://{layers['output']}"}}
        link, _ = neuroglancer_link(run, "local", srv.port)
        with playwright.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM,
                                        args=["--no-sandbox", "--use-angle=swiftshader", "--enable-unsafe-swiftshader"])
            page = browser.new_page(viewport={"width": 800, "height": 600})
            page.goto(link)
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and sum("/layers/output/4_4_40/" in line for line in logs) < 4:
                time.sleep(0.2)
            time.sleep(2)  # let it draw what it fetched
            png = tmp_path / "shot.png"
            page.screenshot(path=str(png))
            browser.close()
    fetched = [line for line in logs if "/layers/" in line]
    assert sum("/layers/input/4_4_40/" in line for line in fetched) >= 4, "\n".join(logs)
    assert sum("/layers/output/4_4_40/" in line for line in fetched) >= 4, "\n".join(logs)
    errors = [line for line in logs if re.search(r'" [45]\d\d ', line)]
    assert not errors, errors
    from PIL import Image

    rgb = np.asarray(Image.open(png).convert("RGB")).astype(int)
    red = (rgb[..., 0] - rgb[..., 1] > 60) & (rgb[..., 0] > 120)  # only the output layer's shader draws red
    dark = rgb.max(-1) < 40  # output 0: the input shows through at 40% dimmed
    assert red.mean() > 0.01 and dark.mean() > 0.005, (red.mean(), dark.mean())
