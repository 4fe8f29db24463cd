#!/usr/bin/env bash
# The SmolLM2-135M draft end to end: build the training corpus, train both stages of
# train/configs/smollm2_135m.py (stage 1 at 1k tokens with anchor-offset positions, stage 2 at the
# target's 8k window starting from stage 1's draft), then benchmark ar, pld and longspec with the new
# draft on the SmolLM2 eval sets. Run from anywhere, with the project installed (on a GPU: the
# `cuda` extra); the training run behind the shipped draft and the results in BENCHMARKS.md came
# from this script on one H200.
#
#   bash benchmarks/smollm2_draft_pipeline.sh prepare   the corpus (train.build_corpus), gzipped into
#                                                      the config's corpus folder (.stage/corpus)
#   bash benchmarks/smollm2_draft_pipeline.sh train     stage 1, then stage 2; the draft to $OUT/draft
#   bash benchmarks/smollm2_draft_pipeline.sh bench     main tasks, then prefill-length buckets
#   bash benchmarks/smollm2_draft_pipeline.sh all       the three in order
#
# A rerun of `train` resumes from the newest checkpoint of each stage. Each step prints a short
# summary last. Knobs (environment), also for quick CPU runs with tiny step counts:
#   PYTHON (python3)  OUT (/tmp/smollm2_draft)  TARGET (the embedded SmolLM2-135M-Instruct GGUF)
#   RUNS (runs/smollm2_135m, the config's output_dir)  CORPUS_DIR (/tmp/smollm2_corpus: build_corpus's output)
#   CORPUS_MB: cap on the corpus's training text in MB (build_corpus --max-mb; default: all of it)
#   STEPS1 / STEPS2: max_steps of each stage (default: the config's)
#   TRAIN_SET1 / TRAIN_SET2: extra space-separated key=value overrides for train.run --set
#   TRAIN1_S / TRAIN2_S: each stage's time_limit_s (load and compile included; default: none): the
#            trainer then stops, saves and exports, so stage 2 still starts from stage 1's draft
#   DRAFT ($RUNS/stage2/draft, else the shipped longspec_jax/drafts/smollm2_135m)  LIMIT (20 per task)
#   PREFILL_LIMIT (5 per bucket)  MAX_NEW (256)  TEMPS (0,1)  MODES (ar,pld,longspec)  PROFILE (0)
#   BENCH_S: seconds for both benchmark processes together (default: none); the main tasks get 3/4
#   RESUME_FROM: a folder with runs_main.jsonl / runs_prefill.jsonl of an earlier bench (e.g.
#            benchmarks/results/smollm2_h200): those runs are kept and only the missing ones are made
set -uo pipefail
cd "$(dirname "$0")/.."
START=$SECONDS
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/smollm2_draft}
RUNS=${RUNS:-runs/smollm2_135m}
TARGET=${TARGET:-}
CORPUS=.stage/corpus  # train/configs/smollm2_135m.py's CORPUS, relative to the repository root
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONWARNINGS="ignore::DeprecationWarning"
mkdir -p "$OUT"

elapsed() { echo "$((SECONDS - START)) s"; }

cmd_prepare() {
    [ -d /usr/share/doc/python3-doc/html/_sources ] || echo "note: no python3-doc: the corpus lacks its docs half (DATA.md)"
    local corpus=${CORPUS_DIR:-/tmp/smollm2_corpus} f
    local args=(--out "$corpus")
    if [ -n "${CORPUS_MB:-}" ]; then args+=(--max-mb "$CORPUS_MB"); fi
    "$PY" -m train.build_corpus "${args[@]}" || { echo "== prepare FAILED: train.build_corpus"; return 1; }
    rm -rf "$CORPUS" && mkdir -p "$CORPUS"
    for f in "$corpus"/train/*.jsonl; do gzip -9nc "$f" >"$CORPUS/$(basename "$f").gz"; done
    echo "== prepare summary ($(elapsed))"
    du -sh "$CORPUS"
}

train_stage() {  # train_stage N STEPS "KEY=VALUE ..." TIME_LIMIT_S
    local n=$1 steps=$2 extra=$3 limit=$4 kv
    local args=(--config smollm2_135m --stage "$n" --set "output_dir=$RUNS")
    if [ -n "$TARGET" ]; then args+=(--target "$TARGET"); fi
    if [ -n "$steps" ]; then args+=(--set "max_steps=$steps"); fi
    if [ -n "$limit" ]; then args+=(--set "time_limit_s=$limit"); fi
    for kv in $extra; do args+=(--set "$kv"); done
    echo "== stage $n: train.run ${args[*]}"
    "$PY" -m train.run "${args[@]}" 2>&1 | tee "$OUT/train_stage$n.txt"
    local rc=${PIPESTATUS[0]}
    cp -f "$RUNS/stage$n/metrics.jsonl" "$OUT/metrics_stage$n.jsonl" 2>/dev/null
    return "$rc"
}

train_summary() {
    echo "== train summary ($(elapsed))"
    "$PY" - "$OUT" <<'EOF'
import json, statistics, sys
from pathlib import Path
out = Path(sys.argv[1])
for n in (1, 2):
    path = out / f"metrics_stage{n}.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
    if not rows:
        print(f"stage {n}: no metrics")
        continue
    rate = statistics.median(r["tokens_per_s"] for r in rows)
    print(f"stage {n}: step {rows[-1]['step']}, loss {rows[0]['loss']:.3f} -> {rows[-1]['loss']:.3f}, "
          f"median {rate:,.0f} tokens/s")
draft = out / "draft"
files = sorted(p.name for p in draft.iterdir()) if draft.is_dir() else []
size = sum(p.stat().st_size for p in draft.iterdir()) / 2**20 if files else 0
print(f"draft: {draft} ({', '.join(files) or 'missing'}; {size:.1f} MiB)")
EOF
}

cmd_train() {
    local rc=0
    train_stage 1 "${STEPS1:-}" "${TRAIN_SET1:-}" "${TRAIN1_S:-}" || rc=$?
    if [ "$rc" = 0 ]; then
        train_stage 2 "${STEPS2:-}" "${TRAIN_SET2:-}" "${TRAIN2_S:-}" || rc=$?
    fi
    if [ "$rc" = 0 ]; then
        rm -rf "$OUT/draft" && cp -r "$RUNS/stage2/draft" "$OUT/draft"
    fi
    train_summary
    if [ "$rc" != 0 ]; then
        echo "train FAILED with exit $rc (130: interrupted, a checkpoint was saved: rerun 'train' to resume)"
    fi
    return "$rc"
}

bench_run() {  # bench_run NAME TASKS LIMIT [TIMEOUT_S]
    local args=(--eval-dir infer/eval_sets/smollm2 --draft "$DRAFT" --modes "${MODES:-ar,pld,longspec}"
                --temperatures "${TEMPS:-0,1}" --tasks "$2" --limit "$3" --max-new-tokens "${MAX_NEW:-256}"
                --json-out "$OUT/bench_$1.json" --runs-out "$OUT/runs_$1.jsonl")
    local run=("$PY" -m infer.benchmark)
    if [ -n "$TARGET" ]; then args+=(--target "$TARGET"); fi
    if [ -n "${RESUME_FROM:-}" ] && [ -f "$RESUME_FROM/runs_$1.jsonl" ]; then
        cp -f "$RESUME_FROM/runs_$1.jsonl" "$OUT/runs_$1.jsonl" && args+=(--resume)
    fi
    if [ "${PROFILE:-0}" = 1 ]; then args+=(--profile); fi
    if [ -n "${4:-}" ]; then run=(timeout -k 20 "$4" "${run[@]}"); fi
    echo "== benchmark $1: infer.benchmark ${args[*]}"
    "${run[@]}" "${args[@]}" >"$OUT/bench_$1.md" 2>"$OUT/bench_$1.log"
    local rc=$?
    if [ "$rc" != 0 ] && [ -s "$OUT/runs_$1.jsonl" ]; then  # stopped early: the tables of the runs it finished
        "$PY" -m infer.benchmark --summarise "$OUT/runs_$1.jsonl" >"$OUT/bench_$1.md" 2>>"$OUT/bench_$1.log"
    fi
    tail -n 5 "$OUT/bench_$1.log"
    return "$rc"
}

cmd_bench() {
    DRAFT=${DRAFT:-$RUNS/stage2/draft}
    [ -d "$DRAFT" ] || DRAFT=longspec_jax/drafts/smollm2_135m
    [ -f "$DRAFT/config.json" ] || { echo "== bench FAILED: $DRAFT has no config.json"; return 1; }
    echo "draft: $DRAFT"
    local rc_main rc_prefill=skipped main_s="" left=""
    if [ -n "${BENCH_S:-}" ]; then main_s=$((BENCH_S * 3 / 4)); fi
    # The main tasks first, in their own process, so a slow prefill sweep cannot cost their results.
    bench_run main code_completion,summarisation "${LIMIT:-20}" "$main_s"; rc_main=$?
    if [ -n "${BENCH_S:-}" ]; then left=$((BENCH_S - (SECONDS - START))); fi
    if [ -z "$left" ] || [ "$left" -ge 60 ]; then
        bench_run prefill prefill_length "${PREFILL_LIMIT:-5}" "$left"; rc_prefill=$?
    fi
    echo "== bench summary ($(elapsed); exit main $rc_main, prefill $rc_prefill)"
    cat "$OUT/bench_main.md" "$OUT/bench_prefill.md" 2>/dev/null
    [ "$rc_main" = 0 ]
}

case "${1:-}" in
    prepare) cmd_prepare ;;
    train) cmd_train ;;
    bench) cmd_bench ;;
    all) cmd_prepare && cmd_train && START=$SECONDS && cmd_bench ;;
    *) echo "usage: bash benchmarks/smollm2_draft_pipeline.sh prepare|train|bench|all (see the header of this file)"; exit 2 ;;
esac
