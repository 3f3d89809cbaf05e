#!/usr/bin/env bash
# The prepared H200 benchmark, at most 8 minutes. Usage:
#   OUT=/folder/for/results bench/gpu/run.sh             # on the GPU machine ($OUT: the device tool's)
#   OUT=/tmp/x bench/gpu/run.sh --dry-run                # on CPU: tiny shapes, same script (< 3 min)
# No network on the GPU machine and nothing is installed: shoal is imported from this checkout
# and the wheels in bench/gpu/wheels (msgspec) are unpacked next to it; torch/triton are the
# machine's own. $OUT gets at most 5 files: bench.tar.gz (every section's log and JSON),
# table.txt, results.json, bench.log, nvidia-smi.txt. The table is printed last.
set -u
here="$(cd "$(dirname "$0")" && pwd)"
export OUT="${OUT:-$here/../results/gpu}"
mkdir -p "$OUT"
python="${PYTHON:-python3}"
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || rm -f "$OUT/nvidia-smi.txt"
# each section has its own limit inside bench.py; this one catches a hang between them
timeout 480 "$python" "$here/bench.py" "$@" 2>&1 | tee "$OUT/bench.log"
exit "${PIPESTATUS[0]}"
