#!/usr/bin/env bash
# The inference benchmarks on one H200, in one call: AR decode (issue 2), LongSpec rounds (issue 6),
# hybrid tree attention (issue 3). Each script checks correctness first, then times, and prints its
# table last; full logs go to $OUT. Usage (from the repo root): bash infer/gpu_benchmarks.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONWARNINGS="ignore::DeprecationWarning"
OUT=${OUT:-/tmp/bench_out}
mkdir -p "$OUT"
python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
timeout 150 python3 -m infer.bench_decode 2>&1 | tee "$OUT/decode.txt"
timeout 260 python3 -m infer.bench_speculative --impl pallas --rounds 16 --repeats 3 2>&1 | tee "$OUT/speculative.txt"
timeout 130 python3 -m infer.bench_attention --budget-s 100 2>&1 | tee "$OUT/attention.txt"
echo "== tails"
for f in decode speculative attention; do echo "-- $f"; tail -n 14 "$OUT/$f.txt"; done
