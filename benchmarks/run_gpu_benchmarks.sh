#!/usr/bin/env bash
# The inference micro-benchmarks on one H200, one after the other: AR decode (bench_decode), LongSpec
# rounds (bench_speculative, one process per target shape) and hybrid tree attention (bench_attention).
# Each script checks correctness first, then times, and prints its table last; full logs go to $OUT.
# Usage (from the repo root): [SECTIONS="decode speculative attention"] bash benchmarks/run_gpu_benchmarks.sh
#   SPEC_SHAPES (vicuna7b llama3_8b)  SPEC_CONTEXTS (4096,16384,32768,65536)  SPEC_S (200 per shape)
#   SPEC_HEADS (auto; auto,target also times each round with the draft reading the target's bf16 head)
#   SPEC_BLOCKS (auto; auto,full also times it with the draft's block in bf16, not int8)
#   SPEC_INT8_PRODUCTS (xla; xla,kernel also times it with the int8 block's products on fused_linear)
#   ATTN_ARGS (extra benchmarks.bench_attention flags)  ATTN_S (130)
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONWARNINGS="ignore::DeprecationWarning"
OUT=${OUT:-/tmp/bench_out}
SECTIONS=${SECTIONS:-decode speculative attention}
mkdir -p "$OUT"
python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
logs=()
for section in $SECTIONS; do
    case $section in
        decode)
            timeout 150 python3 -m benchmarks.bench_decode 2>&1 | tee "$OUT/decode.txt"; logs+=(decode) ;;
        speculative)
            for shape in ${SPEC_SHAPES:-vicuna7b llama3_8b}; do
                timeout "${SPEC_S:-200}" python3 -m benchmarks.bench_speculative --impl pallas --rounds 16 --repeats 3 \
                    --shapes "$shape" --contexts "${SPEC_CONTEXTS:-4096,16384,32768,65536}" \
                    --draft-heads "${SPEC_HEADS:-auto}" --draft-blocks "${SPEC_BLOCKS:-auto}" \
                    --int8-products "${SPEC_INT8_PRODUCTS:-xla}" 2>&1 \
                    | tee "$OUT/speculative_$shape.txt"
                logs+=("speculative_$shape")
            done ;;
        attention)
            # shellcheck disable=SC2086
            timeout "${ATTN_S:-130}" python3 -m benchmarks.bench_attention --budget-s $((${ATTN_S:-130} - 30)) \
                --out "$OUT" ${ATTN_ARGS:-} 2>&1 | tee "$OUT/attention.txt"
            logs+=(attention) ;;
        *) echo "unknown section $section (decode, speculative, attention)"; exit 2 ;;
    esac
done
echo "== tails"
for f in "${logs[@]}"; do echo "-- $f"; tail -n 14 "$OUT/$f.txt"; done
