#!/usr/bin/env bash
# Issue 7 on one H200 in device calls made back to back: files outside the repository (the staged
# GGUF, the installed wheels, the training runs) survive between calls only while the machine stays
# warm (~30 s after a call). Each call carries at most 64 MiB with the working tree (~12 MiB), hence
# the GGUF in three parts. Every subcommand first stages the GGUF parts it was carried
# (.stage/partN) and joins the GGUF once all parts are there.
#
#   here, once:  bash infer/gpu_issue7.sh prepare   (on the CPU machine, with the project venv active:
#            the git-ignored inputs a fresh checkout lacks: .whl wheels, .stage/corpus, GGUF parts)
#   call 1:  bash infer/gpu_issue7.sh stage    carry .stage/part1 .stage/sha256 .whl
#            installs the missing wheels, stages GGUF part 1, checks every import
#   call 2:  bash infer/gpu_issue7.sh stage    carry .stage/part2 .stage/sha256
#   call 3:  bash infer/gpu_issue7.sh train    carry .stage/part3 .stage/sha256 .stage/corpus
#            joins the GGUF, trains stage 1 then stage 2, exports the draft to $OUT/draft
#   call 4:  bash infer/gpu_issue7.sh bench
#            ar, pld and longspec at T = 0 and 1 on the eval sets; each run to $OUT/runs_*.jsonl as it
#            finishes, tables to $OUT/bench_*.md. Benchmark only, on a fresh machine: calls 1 and 2
#            (call 1 may carry just .whl/gguf-*.whl), then bench carrying .stage/part3 .stage/sha256
#            (the draft defaults to the shipped one).
#
# A device call returns at most 8 files from $OUT: bench alone writes 8 (bench_*.json/md/log and
# runs_*.jsonl for main and prefill), so a call running more beside it keeps other outputs elsewhere.
#
# Each subcommand prints a short summary last. Knobs (environment), for CPU dry runs and reruns:
#   PYTHON (python3)  STAGE_DIR (/root/stage)  SITE (/tmp/site)  OUT (/tmp/issue7_out)
#   RUNS ($STAGE_DIR/runs/smollm2_135m)  DATA (.stage/corpus)
#   STEPS1 / STEPS2: max_steps of each stage (default: the config's)
#   TRAIN_SET1 / TRAIN_SET2: extra space-separated key=value overrides for train.run --set
#   TRAIN1_S (350) / TRAIN2_S (150): each stage's time_limit_s (load and compile included): the trainer
#            then stops, saves and exports, so stage 2 still starts from stage 1's draft; a rerun resumes
#   DRAFT ($RUNS/stage2/draft, else the shipped longspec_jax/drafts/smollm2_135m)  LIMIT (20)
#   PREFILL_LIMIT (5 per bucket)  MAX_NEW (256)  TEMPS (0,1)  MODES (ar,pld,longspec)  PROFILE (0)
#   BENCH_S (540): seconds for both benchmark processes together
#   RESUME_FROM: a folder with runs_main.jsonl / runs_prefill.jsonl of an earlier bench call (e.g.
#            infer/results/smollm2_h200): those runs are kept and only the missing ones are made
set -uo pipefail
cd "$(dirname "$0")/.."
START=$SECONDS
PY=${PYTHON:-python3}
STAGE_DIR=${STAGE_DIR:-/root/stage}
SITE=${SITE:-/tmp/site}
OUT=${OUT:-/tmp/issue7_out}
RUNS=${RUNS:-$STAGE_DIR/runs/smollm2_135m}
DATA=${DATA:-.stage/corpus}
GGUF=$STAGE_DIR/SmolLM2-135M-Instruct.gguf
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONWARNINGS="ignore::DeprecationWarning"
mkdir -p "$OUT"

# Every module the trainer and the benchmark import that a bare GPU image may lack.
MODULES="jax flax optax orbax.checkpoint transformers tokenizers safetensors pyarrow numpy grain datasets
gguf tensorboardX tqdm xxhash pandas dill multiprocess array_record portpicker"

missing_modules() {
    # shellcheck disable=SC2086
    "$PY" -c 'import importlib.util, sys
def absent(name):
    try:
        return importlib.util.find_spec(name) is None
    except ImportError:  # a dotted name whose parent package is missing
        return True
print(" ".join(m for m in sys.argv[1:] if absent(m)))' $MODULES
}

ensure_packages() {
    if [ -d "$SITE" ]; then export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"; fi
    local missing
    missing=$(missing_modules)
    # Once per machine: a second install into the same folder would only warn about every package.
    if [ -n "$missing" ] && [ -d .whl ] && [ ! -f "$SITE/.installed" ]; then
        echo "installing .whl/*.whl into $SITE (missing: $missing)"
        "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .whl/*.whl || return 1
        touch "$SITE/.installed"
        export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
        missing=$(missing_modules)
    fi
    MISSING=$missing
}

# infer.stage_gguf with its GPU-side folder pointed at $STAGE_DIR (a scratch folder in dry runs).
stage_gguf() {
    "$PY" -c 'import sys
from pathlib import Path
import infer.stage_gguf as stage
stage.REMOTE_DIR = Path(sys.argv[1])
stage.main(sys.argv[2:])' "$STAGE_DIR" "$@"
}

elapsed() { echo "$((SECONDS - START)) s"; }

stage_carried_parts() {  # put every carried .stage/partN; join once all parts are staged
    local part n
    for part in .stage/part*; do
        [ -f "$part" ] || continue
        n=${part#.stage/part}
        stage_gguf put-part "$n" || return 1
    done
    if [ ! -f "$GGUF" ] && "$PY" -c 'import sys; from pathlib import Path; import infer.stage_gguf as s
sys.exit(0 if all((Path(sys.argv[1]) / f"part{i + 1}").is_file() for i in range(s.PARTS)) else 1)' "$STAGE_DIR"; then
        stage_gguf join || return 1
    fi
}

cmd_stage() {
    ensure_packages || { echo "== stage FAILED: wheel install"; exit 1; }
    stage_carried_parts || { echo "== stage FAILED: staging the GGUF parts"; exit 1; }
    "$PY" -c 'import jax; print("jax", jax.__version__, jax.devices())' 2>&1 | tail -n 1
    echo "== stage summary ($(elapsed))"
    ls -l "$STAGE_DIR"
    echo "missing modules: ${MISSING:-none}"
    [ -z "$MISSING" ]
}

train_stage() {  # train_stage N STEPS "KEY=VALUE ..." TIMEOUT_S
    local n=$1 steps=$2 extra=$3 limit=$4 kv
    local args=(--config smollm2_135m --target "$GGUF" --data "$DATA" --stage "$n" --set "output_dir=$RUNS")
    if [ -n "$steps" ]; then args+=(--set "max_steps=$steps"); fi
    for kv in $extra; do args+=(--set "$kv"); done
    echo "== stage $n: train.run ${args[*]}"
    # The trainer stops itself at time_limit_s (load and compile included), saves and exports; the
    # outer timeout is only a backstop (SIGINT: the trainer saves a checkpoint, exports nothing).
    args+=(--set "time_limit_s=$limit")
    timeout -s INT -k 30 $((limit + 40)) "$PY" -m train.run "${args[@]}" 2>&1 | tee "$OUT/train_stage$n.txt"
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
    ensure_packages || { echo "== train FAILED: wheel install"; exit 1; }
    stage_carried_parts && [ -f "$GGUF" ] || { echo "== train FAILED: the GGUF is not complete (stage parts 1 and 2 first)"; exit 1; }
    local rc=0
    train_stage 1 "${STEPS1:-}" "${TRAIN_SET1:-}" "${TRAIN1_S:-350}" || rc=$?
    if [ "$rc" = 0 ]; then
        train_stage 2 "${STEPS2:-}" "${TRAIN_SET2:-}" "${TRAIN2_S:-150}" || rc=$?
    fi
    if [ "$rc" = 0 ]; then
        rm -rf "$OUT/draft" && cp -r "$RUNS/stage2/draft" "$OUT/draft"
    fi
    train_summary
    if [ "$rc" != 0 ]; then
        echo "train FAILED with exit $rc (130: the backstop timeout hit, a checkpoint was saved: rerun 'train' to resume)"
    fi
    return "$rc"
}

bench_run() {  # bench_run NAME TASKS LIMIT TIMEOUT_S
    local args=(--eval-dir infer/eval_sets/smollm2 --target "$GGUF" --draft "$DRAFT" --modes "${MODES:-ar,pld,longspec}"
                --temperatures "${TEMPS:-0,1}" --tasks "$2" --limit "$3" --max-new-tokens "${MAX_NEW:-256}"
                --json-out "$OUT/bench_$1.json" --runs-out "$OUT/runs_$1.jsonl")
    if [ -n "${RESUME_FROM:-}" ] && [ -f "$RESUME_FROM/runs_$1.jsonl" ]; then
        cp -f "$RESUME_FROM/runs_$1.jsonl" "$OUT/runs_$1.jsonl" && args+=(--resume)
    fi
    if [ "${PROFILE:-0}" = 1 ]; then args+=(--profile); fi
    echo "== benchmark $1: infer.benchmark ${args[*]}"
    timeout -k 20 "$4" "$PY" -m infer.benchmark "${args[@]}" >"$OUT/bench_$1.md" 2>"$OUT/bench_$1.log"
    local rc=$?
    if [ "$rc" != 0 ] && [ -s "$OUT/runs_$1.jsonl" ]; then  # killed: the tables of the runs it finished
        "$PY" -m infer.benchmark --summarise "$OUT/runs_$1.jsonl" >"$OUT/bench_$1.md" 2>>"$OUT/bench_$1.log"
    fi
    tail -n 5 "$OUT/bench_$1.log"
    return "$rc"
}

cmd_bench() {
    ensure_packages || { echo "== bench FAILED: wheel install"; exit 1; }
    stage_carried_parts || { echo "== bench FAILED: staging the GGUF parts"; exit 1; }
    DRAFT=${DRAFT:-$RUNS/stage2/draft}
    [ -d "$DRAFT" ] || DRAFT=longspec_jax/drafts/smollm2_135m
    if [ ! -f "$GGUF" ] || [ ! -f "$DRAFT/config.json" ]; then
        echo "== bench FAILED: $GGUF or $DRAFT is missing (the machine went cold?): stage parts 1 and 2, then bench carrying part 3"
        exit 1
    fi
    echo "draft: $DRAFT"
    local budget=${BENCH_S:-540} rc_main rc_prefill=skipped
    # The main tasks first, in their own process, so a slow prefill sweep cannot cost their results.
    bench_run main code_completion,summarisation "${LIMIT:-20}" $((budget * 3 / 4)); rc_main=$?
    local left=$((budget - (SECONDS - START)))
    if [ "$left" -ge 60 ]; then bench_run prefill prefill_length "${PREFILL_LIMIT:-5}" "$left"; rc_prefill=$?; fi
    echo "== bench summary ($(elapsed); exit main $rc_main, prefill $rc_prefill)"
    cat "$OUT/bench_main.md" "$OUT/bench_prefill.md" 2>/dev/null
    [ "$rc_main" = 0 ]
}

# Wheels for what the GPU image lacks (KINDS.md lists what it has), for Python 3.12 on x86-64.
GPU_WHEELS="grain==0.2.18 datasets==5.2.0 gguf==0.19.0 array-record==0.8.6 dill==0.4.1 multiprocess==0.70.19
portpicker==1.6.0 tensorboardX==2.6.5 xxhash==4.1.0"

cmd_prepare() {
    set -e
    # shellcheck disable=SC2086
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .whl $GPU_WHEELS
    [ -d /usr/share/doc/python3-doc/html/_sources ] || apt-get install -y -q python3-doc  # DATA.md: the docs half
    local corpus=${CORPUS_DIR:-/tmp/smollm2_corpus}
    "$PY" -m train.build_corpus --out "$corpus"
    mkdir -p .stage/corpus
    for f in "$corpus"/train/*.jsonl; do gzip -9nc "$f" > ".stage/corpus/$(basename "$f").gz"; done
    "$PY" -m infer.stage_gguf split
    echo "== prepare summary ($(elapsed))"; du -sh .whl .stage/corpus .stage/part*
}

case "${1:-}" in
    prepare) cmd_prepare ;;
    stage) cmd_stage ;;
    train) cmd_train ;;
    bench) cmd_bench ;;
    *) echo "usage: bash infer/gpu_issue7.sh prepare|stage|train|bench (see the header of this file)"; exit 2 ;;
esac
