#!/usr/bin/env bash
# The prepared H200 benchmark. Usage: OUT=/folder/for/logs bench/gpu/run.sh [--smoke]
# No network on the GPU machine: shoal is imported from this checkout and the wheels in
# bench/gpu/wheels (msgspec) are unpacked next to it; torch/triton are the machine's own.
set -u
here="$(cd "$(dirname "$0")" && pwd)"
export OUT="${OUT:-$here/../results/gpu}"
mkdir -p "$OUT"
python="${PYTHON:-python3}"
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || true
# 8 minutes in all; each section has its own limit inside bench.py
timeout 470 "$python" "$here/bench.py" "$@" 2>&1 | tee "$OUT/bench.log"
exit "${PIPESTATUS[0]}"
