#!/usr/bin/env bash
# One command that checks a GPU machine: what the device is, the gpu-marked
# tests, the device tests on the real device, the device calibration and the GPU benchmark; logs
# and JSON under ${OUT:-/tmp/gpu_check}.  The wheels the machine lacks (pyFFTW) travel in .whl/
# (git-ignored) when the machine has no package index; about 7 result files. On an H100: tests
# about 50 s, calibration and benchmark about 90 s.
# Each stage has its own time limit (seconds): GPU_CHECK_TESTS, GPU_CHECK_BENCH; the benchmark's
# arguments: GPU_CHECK_BENCH_ARGS; GPU_CHECK_K: a pytest -k expression for both test files.
set -u
out=${OUT:-/tmp/gpu_check}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 NUMBA_THREADING_LAYER=threadsafe
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=$PWD:/tmp/site
else
  export PYTHONPATH=$PWD
fi
{ nvidia-smi; python3 -c "import cupy; cupy.show_config()"
  python3 -c "import torch, numpy, numba, scipy; print('torch', torch.__version__, torch.version.cuda, torch.backends.cudnn.version(), 'numpy', numpy.__version__, 'numba', numba.__version__, 'scipy', scipy.__version__)"
  python3 -c "import pyfftw; print('pyfftw', pyfftw.__version__)"; nproc; } > "$out/env.txt" 2>&1
tail -4 "$out/env.txt"
t0=$(date +%s)
# the gpu-marked tests and the device suite on the real device, side by side (one GPU, 16 cores)
k=(); [ -n "${GPU_CHECK_K:-}" ] && k=(-k "$GPU_CHECK_K")
timeout "${GPU_CHECK_TESTS:-200}" python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu.py "${k[@]}" \
  > "$out/pytest-gpu.txt" 2>&1 &
ZNNI_TEST_DEVICE=cuda timeout "${GPU_CHECK_TESTS:-200}" python3 -m pytest -q -p no:cacheprovider -n 3 \
  tests/test_device.py "${k[@]}" > "$out/pytest-device.txt" 2>&1
wait
echo "tests: $(( $(date +%s) - t0 )) s"
tail -25 "$out/pytest-gpu.txt"; tail -40 "$out/pytest-device.txt"
t0=$(date +%s)
export ZNNI_CACHE_DIR=/tmp/znni-cache  # the calibrations below serve the benchmark
timeout "${GPU_CHECK_BENCH:-150}" python3 - <<'PY' > "$out/calibration.json" 2>&1
import json, time, cupy
from znni_core.plan.gpu_timing import calibrate_device
from znni_core.plan.search import default_threads
from znni_core.plan.timing import calibrate
t0 = time.perf_counter()
gpu = calibrate_device(cupy, refresh=True)
t1 = time.perf_counter()
cpu = calibrate(default_threads())
print(json.dumps({"gpu": gpu.to_dict(), "gpu_s": t1 - t0, "cpu": cpu.to_dict(), "cpu_s": time.perf_counter() - t1}, indent=1))
PY
cat "$out/calibration.json"
# shellcheck disable=SC2086
# the shapes of the first H100 run (about 80 s there): PyTorch's dense n726 at width 80 takes minutes
timeout "${GPU_CHECK_BENCH:-240}" python3 -m benchmarks.gpu --out "$out" \
  ${GPU_CHECK_BENCH_ARGS:---nets boundary,n337 --size 128 --rounds 3 --steps} 2>&1 \
  | tee "$out/bench.txt" | tail -20
echo "calibration + benchmark: $(( $(date +%s) - t0 )) s"
cat "$out/GPU.md" 2>/dev/null
