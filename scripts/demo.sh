#!/usr/bin/env bash
# `make demo`: generate a small EM-like volume (precomputed) and a small deterministic network,
# run the whole workflow with the local profile, print where output, report and preview are.
# Needs no network access and no GPU. Output goes to demo_out/ (git-ignored).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${ZNNI_DEMO_OUT:-demo_out}"
case "$OUT" in /*) ;; *) OUT="$PWD/$OUT" ;; esac   # absolute from here on (printed paths)
# Jobs are separate processes: let Python cache bytecode (some machines set PYTHONDONTWRITEBYTECODE,
# which costs ~5 s of compiling per job) beside the sources, where setup compiled the venv's (a
# PYTHONPYCACHEPREFIX of its own would compile it all again: 8 s of CPU in each first process),
# and keep numba's compiled kernels between jobs.
unset PYTHONDONTWRITEBYTECODE
export NUMBA_THREADING_LAYER="${NUMBA_THREADING_LAYER:-threadsafe}"
start=$(date +%s)

rm -rf "$OUT/work" "$OUT/output"          # a fresh run; the input is regenerated identically
# Ready this host once (kept in ZNNI_CACHE_DIR, default ~/.cache/znni; seconds when already done):
# the vector width measured (AVX-512 hosts), every kernel compiled, the time model calibrated for
# the local profile's 1 thread per job, so the workflow's first jobs do not compile.
znni warmup --threads 1
znni demo-data "$OUT"
snakemake --profile profiles/local --configfile "$OUT/config.yaml"

echo
echo "znni demo finished in $(( $(date +%s) - start )) s"
echo "  input layer:  $OUT/em"
echo "  output layer: $OUT/output"
echo "  report:       $OUT/work/report/report.html"
echo "  preview:      $OUT/work/report/preview.png"
echo "  view:         znni serve $OUT/work --port 1337, then open the Neuroglancer link in the report"
