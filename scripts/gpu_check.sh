#!/usr/bin/env bash
# The one command for a lent GPU machine (see ../shared/GPU.md): what the device is, the
# gpu-marked tests and the device tests, results as JSON under ${OUT:-/tmp/gpu_check}.
# Wheels the machine lacks travel in wheels/ (git-ignored; `run(carry=["wheels"])`).
set -u
out=${OUT:-/tmp/gpu_check}
mkdir -p "$out"
nvidia-smi | tee "$out/nvidia-smi.txt"
python -c "import cupy; cupy.show_config()" > "$out/cupy.txt" 2>&1
python -c "import torch; print(torch.__version__, torch.version.cuda, torch.backends.cudnn.version())" > "$out/torch.txt" 2>&1
if [ -d wheels ]; then pip install -q --no-index --find-links wheels/ -e . 2>&1 | tail -3; fi
python -m pytest -q -m gpu tests/test_gpu.py --junitxml "$out/gpu.xml" 2>&1 | tail -20 | tee "$out/pytest-gpu.txt"
python - <<'PY' | tee "$out/calibration.json"
import json, cupy
from znni_core.plan.gpu_timing import calibrate_device
print(json.dumps(calibrate_device(cupy, refresh=True), indent=1))
PY
python -m benchmarks.gpu --rounds 3 --out "$out" 2>&1 | tail -30
