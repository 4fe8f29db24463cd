"""Benchmark decoding modes side by side on the evaluation sets: tau, tokens/s and speedup over AR.

    python -m infer.benchmark --eval-dir infer/eval_sets/smollm2 [--target PATH] [--draft PATH]
        [--modes ar,pld,longspec,auto,longspec:8-8-8,pld:1] [--temperatures 0,1] [--max-new-tokens 256] [--limit N]
        [--tasks code_completion,summarisation,prefill_length] [--tree-widths 4,16,16,16,11]
        [--json-out F] [--runs-out F [--resume]] [--profile] [--ignore-eos] [--repeats N]
    python -m infer.benchmark --summarise RUNS.jsonl [RUNS.jsonl ...] [--json-out F]

Every prompt runs every mode at every temperature in this one process; with --batch-sizes 1,4,8
also as batches of consecutive prompts of a task (a batch is one run; a remainder shorter than the
batch is left out). Mode "auto" is the adaptive engine (AR, prompt lookup and the draft's trees,
chosen each round); its round costs are calibrated during the warm-up. Compilation is
timed apart from prefill and decode (stats.compile_s); with --repeats N each run is made N times and
the one of median decode time kept (all N times are recorded; mode auto starts each of them from what
it remembered before the prompt), and the first run of a (mode, cache size,
temperature, batch) is a warm-up that is not counted: `--warm-up N` requests (default: GPU_WARM_UP
on a GPU, whose runtime builds the loop's command buffers over a process's first calls of it, 1
elsewhere), and for "auto" more while a request still times candidates (WARM_UP_REQUESTS at most),
so timings hold neither compilation nor first-run costs.
tokens/s of a group = its new tokens / its decode seconds; speedup = that over AR's in the same
task and temperature. At T = 0 each speculative run is also checked to give exactly AR's tokens
(lossless decoding). A mode may carry its own tree (`longspec:8-8-8`, `pld:1`: reported under
that name beside the plain mode), and a draft's mode the suffix `+full` (`auto+full`,
`longspec:4-4-4+full`: its draft proposes from the whole vocabulary, not only the candidate tokens
saved with it). `longspec+pld10` / `auto+pld10` put a 10-token prompt-lookup chain beside the tree
(mode auto's greedy tree carries one by default: `auto+pld0` runs without, with longspec's whole
tree, a (4, 4, 4) one and a chain alone). A mode the build cannot run (no draft, engine missing)
is skipped with its reason.
Each run is appended to --runs-out as it finishes (a killed benchmark keeps what it did; the same command with --resume
runs only what is missing; --summarise builds the tables from such files); the full results go to
--json-out; a markdown table is printed last.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

from longspec_jax.errors import UserError

TASKS = ("code_completion", "summarisation", "prefill_length")
WARM_UP_REQUESTS = 3
# Warm-up requests per mode and decode shape on a GPU. There XLA records the loop's command buffers
# (CUDA graphs) over a process's first calls of a program: on the H200 (SmolLM2, 2026-12-04) each of
# the first five decode calls created 60-110 graphs and took up to 8-51 ms longer than the same request
# later, and later calls created none (benchmarks.command_buffer_log).
GPU_WARM_UP = 6


def load_eval_sets(eval_dir: str | Path, tasks=TASKS, limit: int | None = None) -> tuple[dict, list[dict]]:
    """(manifest, items). limit: the first N prompts of each task (of each bucket for prefill_length)."""
    eval_dir = Path(eval_dir)
    manifest_path = eval_dir / "manifest.json"
    if not manifest_path.is_file():
        raise UserError(
            f"{eval_dir} holds no manifest.json: build the sets with `python -m infer.build_eval_sets --out {eval_dir}`"
        )
    manifest = json.loads(manifest_path.read_text())
    items = []
    for task in tasks:
        path = eval_dir / f"{task}.jsonl"
        if not path.is_file():
            raise UserError(f"{path} is missing: rebuild the eval sets or drop {task} from --tasks")
        taken: dict[str | None, int] = defaultdict(int)
        for line in path.read_text(encoding="utf-8").splitlines():
            item = json.loads(line)
            group = item.get("bucket")
            if limit is None or taken[group] < limit:
                taken[group] += 1
                items.append(item)
    return manifest, items


def _tokens_digest(tokens: list[int]) -> str:
    return hashlib.sha1(json.dumps(tokens).encode()).hexdigest()[:12]


FULL_VOCABULARY = "+full"  # a --modes suffix: the draft proposes from the whole vocabulary
LOOKUP_CHAIN = "+pld"  # a --modes suffix of longspec and auto: "+pld10", a 10-token lookup chain beside the tree


def parse_mode_spec(spec: str) -> tuple[str, tuple[int, ...] | None]:
    """(mode, its own tree widths or None) of a --modes entry: "ar", "auto", "pld", "longspec", or
    "pld:1" / "longspec:8-8-8" (a chain or tree of these widths, run and reported as its own mode);
    longspec and auto may then take "+pldN" (a prompt-lookup chain of N tokens beside the tree,
    auto's deep greedy one: `lookup_tokens`); a draft's mode may end in "+full" (its draft proposes from the whole
    vocabulary, not only its candidate tokens: `full_vocabulary`)."""
    from infer.generate import parse_widths
    from longspec_jax.generation import AUTO_MODE, MODES

    base = spec.removesuffix(FULL_VOCABULARY)
    with_lookup = lookup_tokens(spec) is not None
    mode, _, widths = base.partition(LOOKUP_CHAIN)[0].partition(":")
    if (
        mode not in (*MODES, AUTO_MODE)
        or (widths and mode not in ("pld", "longspec"))
        or (base != spec and mode not in ("longspec", AUTO_MODE))
        or (with_lookup and mode not in ("longspec", AUTO_MODE))
    ):
        raise UserError(
            f"unknown mode {spec!r} in --modes: choose from {', '.join((*MODES, AUTO_MODE))}, "
            "or give pld / longspec a tree as in pld:1 or longspec:8-8-8; longspec and auto may take a lookup chain "
            "as in longspec+pld10 and end in +full"
        )
    if not widths:
        return mode, None
    parsed = parse_widths(widths, sep="-")
    if parsed is None:
        raise UserError(f"the tree in --modes {spec!r} must be positive widths joined by '-', as in longspec:8-8-8")
    return mode, parsed


def lookup_tokens(spec: str) -> int | None:
    """The prompt-lookup chain a --modes entry puts beside its tree ("longspec+pld10": 10; "auto+pld0":
    none; no suffix: None, the mode's default: none in longspec, `Generator`'s beside auto's greedy trees)."""
    _, found, count = spec.removesuffix(FULL_VOCABULARY).partition(LOOKUP_CHAIN)
    if not found:
        return None
    if not count.isdigit():
        raise UserError(
            f"the lookup chain in --modes {spec!r} must be a token count, as in longspec+pld10 (auto+pld0: none)"
        )
    return int(count)


def full_vocabulary(spec: str) -> bool:
    """Whether a --modes entry runs its draft over the whole vocabulary (`parse_mode_spec`)."""
    return spec.endswith(FULL_VOCABULARY)


def run_benchmark(
    target,
    draft,
    items: list[dict],
    *,
    sampling_draft=None,
    modes,
    temperatures,
    max_new_tokens: int,
    seed: int = 0,
    attn_impl: str | None = None,
    ar_attn_impl: str | None = None,
    tree_widths=None,
    profile: bool = False,
    log=print,
    on_run=None,
    done: tuple[dict, ...] = (),
    batch_sizes=(1,),
    ignore_eos: bool = False,
    repeats: int = 1,
    warm_up: int = 1,
) -> dict:
    """Run every item in every mode and temperature. -> {"runs": [...], "skipped_modes": {mode: why}}.
    on_run(run_record) is called as each run finishes. `done`: records of an earlier, interrupted
    benchmark: their (prompt, mode, temperature) are not run again (and are not in "runs").
    modes: mode names, or `parse_mode_spec`'s "MODE:W1-W2-..." for a mode with its own tree.
    tree_widths: a plain "longspec"'s tree (default: the engine's); each record of a mode with a tree
    carries the one used. sampling_draft: the draft of the draft modes' sampled runs (default: draft)."""
    from longspec_jax import acceptance_memory
    from longspec_jax.generation import Generator
    from longspec_jax.proposers import resolve_widths

    skipped: dict[str, str] = {}
    generators = {}
    widths_used: dict[str, list[int] | None] = {}
    for spec in sorted(modes, key=lambda m: m != "ar"):  # AR first: the others are checked against it
        mode, own_widths = parse_mode_spec(spec)
        if mode == "longspec" and draft is None:
            skipped[spec] = "no draft: pass --draft PATH (only the embedded SmolLM2 ships one)"
            continue
        widths = own_widths if own_widths is not None else (tree_widths if mode == "longspec" else None)
        if mode in ("longspec", "pld"):
            try:
                widths_used[spec] = list(resolve_widths(mode, widths, target.config.vocab_size))
            except UserError as e:
                skipped[spec] = str(e)
                continue
        impl = ar_attn_impl if mode == "ar" and ar_attn_impl else attn_impl
        spec_draft = draft if mode in ("longspec", "auto") else None
        spec_sampling_draft = (sampling_draft or draft) if mode in ("longspec", "auto") else None
        if spec_draft is not None and full_vocabulary(spec):
            spec_draft = spec_draft.with_candidate_tokens(None)
            spec_sampling_draft = spec_sampling_draft.with_candidate_tokens(None)
        generators[spec] = Generator(
            target,
            spec_draft,
            sampling_draft=spec_sampling_draft,
            mode=mode,
            attn_impl=impl,
            tree_widths=widths,
            lookup_tokens=lookup_tokens(spec),
        )
    for mode, why in skipped.items():
        log(f"skipping mode {mode}: {why}")
    if draft is None and any(parse_mode_spec(spec)[0] == "auto" for spec in generators):
        log("mode auto runs without a draft (AR and prompt lookup only): pass --draft PATH for LongSpec trees")

    window = target.config.max_position_embeddings
    warmed: set[tuple[str, int, float, int]] = set()  # (mode, cache rows, temperature, batch)
    finished = {(r["id"], r["mode"], r["temperature"]) for r in done}
    ar_digest = {(r["id"], r["temperature"]): r["tokens_sha1"] for r in done if r["mode"] == "ar"}
    runs = []
    for index, item in enumerate(_batched(items, batch_sizes, log)):
        if item["prompt_len"] + max_new_tokens > window:
            log(
                f"skipping {item['id']}: {item['prompt_len']} + {max_new_tokens} new tokens "
                f"exceed the {window}-token window"
            )
            continue
        for temperature in temperatures:
            kwargs = dict(max_new_tokens=max_new_tokens, temperature=temperature, seed=seed)
            if ignore_eos:
                kwargs["eos_token_ids"] = ()
            # Greedy and sampling may be different programs: warm each up once per cache size (the
            # decode loop's shapes, as the generator plans them for this request; a new prompt
            # bucket only compiles prefill, timed apart).
            timed: dict[str, list] = {m: [] for m in generators if (item["id"], m, temperature) not in finished}
            failed: dict[str, UserError] = {}  # a mode that raises one is skipped from here on
            for mode in list(timed):
                try:
                    rows = generators[mode].cache_rows(
                        item["prompt_len"], item["batch"], max_new_tokens=max_new_tokens, temperature=temperature
                    )
                    if (mode, rows, temperature, item["batch"]) not in warmed:
                        _warm_up(generators[mode], item["prompt_ids"], kwargs, warm_up)
                        warmed.add((mode, rows, temperature, item["batch"]))
                except UserError as e:
                    failed[mode] = e
                    del timed[mode]
            # The repeats go round the modes, so a machine's slow minutes fall on every mode alike,
            # and each prompt starts the round with another mode, so no mode always runs right after
            # the same other one (a GPU's state after one mode's requests can favour or slow the next).
            # Each repeat starts from what mode auto remembered before this prompt (acceptance_memory):
            # its second timing of a prompt would otherwise start from what the first kept of the
            # same text, which a server's next request, another text, does not have.
            remembered = acceptance_memory.memory_snapshot()
            for _ in range(repeats):
                acceptance_memory.restore_memory(remembered)
                for mode in mode_order(list(timed), index):
                    if mode not in timed:  # failed earlier in this round
                        continue
                    try:
                        timed[mode].append(generators[mode].generate(item["prompt_ids"], profile=profile, **kwargs))
                    except UserError as e:
                        failed[mode] = e
                        del timed[mode]
            for mode, e in failed.items():
                skipped[mode] = str(e)
                del generators[mode]
                log(f"skipping mode {mode}: {e}")
            for mode, results in timed.items():
                result = sorted(results, key=lambda r: r.stats.decode_s)[(repeats - 1) // 2]  # the median
                tokens, stats = (result.tokens[0] if item["batch"] == 1 else result.tokens), result.stats
                digest = _tokens_digest(tokens)
                if mode == "ar":
                    ar_digest[item["id"], temperature] = digest
                reference = ar_digest.get((item["id"], temperature))
                record = {
                    "id": item["id"],
                    "task": item["task"],
                    "bucket": item.get("bucket"),
                    "prompt_len": item["prompt_len"],
                    "batch": item["batch"],
                    "mode": mode,
                    "temperature": temperature,
                    "new_tokens": stats.new_tokens,
                    "prefill_s": stats.prefill_s,
                    "decode_s": stats.decode_s,
                    "decode_s_repeats": [r.stats.decode_s for r in results],
                    "tokens_per_s": stats.tokens_per_s,
                    "tau": stats.tau,
                    "rounds": stats.rounds,
                    "compile_s": stats.compile_s,
                    "target_cache_bytes": stats.target_cache_bytes,
                    "draft_cache_bytes": stats.draft_cache_bytes,
                    "profile": stats.profile,
                    "policy": stats.policy,
                    "runs": stats.runs,
                    "tokens_sha1": digest,
                    "tree_widths": widths_used.get(mode),
                    "matches_ar": (digest == reference) if temperature == 0 and mode != "ar" and reference else None,
                }
                runs.append(record)
                if on_run is not None:
                    on_run(record)
                log(
                    f"{item['id']} ({item['prompt_len']} tokens) {mode} T={temperature}: tau {stats.tau:.2f}, "
                    f"{stats.tokens_per_s:.1f} tok/s, {stats.new_tokens} tokens"
                )
    return {"runs": runs, "skipped_modes": skipped}


def mode_order(modes: list[str], index: int) -> list[str]:
    """The order prompt number `index` times its modes in: rotated to start at mode index % n, and
    reversed in every other cycle of n prompts, so that over 2n prompts each mode runs right after
    each other one."""
    if not modes:
        return []
    k = index % len(modes)
    order = modes[k:] + modes[:k]
    return order[::-1] if (index // len(modes)) % 2 else order


def _warm_up(generator, prompt_ids, kwargs, requests: int = 1) -> None:
    """Compile a shape's programs, let the runtime build its command buffers (`requests` requests),
    and for mode auto measure its round costs, outside the timed runs: a request that ends before
    every candidate was timed leaves the rest to the next request (calibration.py), so warm up until
    a request finds them all kept (WARM_UP_REQUESTS at most, or `requests` if more)."""
    for made in range(1, max(requests, WARM_UP_REQUESTS) + 1):
        stats = generator.generate(prompt_ids, **kwargs).stats
        if made >= requests and (stats.policy or {}).get("calibration", "kept") == "kept":
            return


def _batched(items: list[dict], batch_sizes, log) -> list[dict]:
    """The runs to make: each item alone (batch 1), and for each larger batch size B, groups of B
    consecutive items of one task as one item (ids joined by '+', the longest prompt's length)."""
    units = []
    for b in batch_sizes:
        if b == 1:
            units += [dict(item, batch=1) for item in items]
            continue
        by_task: dict[str, list[dict]] = defaultdict(list)
        for item in items:
            by_task[item["task"]].append(item)
        for task, group in by_task.items():
            whole = len(group) - len(group) % b
            if whole < len(group):
                log(f"batch {b}: leaving out the last {len(group) - whole} {task} prompts (not a whole batch)")
            for start in range(0, whole, b):
                part = group[start : start + b]
                units.append(
                    {
                        "id": "+".join(i["id"] for i in part),
                        "task": task,
                        "bucket": None,
                        "prompt_len": max(i["prompt_len"] for i in part),
                        "prompt_ids": [i["prompt_ids"] for i in part],
                        "batch": b,
                    }
                )
    return units


def _group_stats(runs: list[dict]) -> dict:
    decode_s = sum(r["decode_s"] for r in runs)
    new_tokens = sum(r["new_tokens"] for r in runs)
    checks = [r["matches_ar"] for r in runs if r["matches_ar"] is not None]
    profile_keys = sorted({k for r in runs for k in r["profile"]})
    return {
        "prompts": len(runs),
        "mean_prompt_len": statistics.fmean(r["prompt_len"] for r in runs),
        "mean_tau": statistics.fmean(r["tau"] for r in runs),
        "tokens_per_s": new_tokens / decode_s if decode_s > 0 else 0.0,
        "new_tokens": new_tokens,
        "mean_prefill_s": statistics.fmean(r["prefill_s"] for r in runs),
        "mean_decode_s": statistics.fmean(r["decode_s"] for r in runs),
        "mean_rounds": statistics.fmean(r["rounds"] for r in runs),
        "ms_per_round": 1e3 * decode_s / max(sum(r["rounds"] for r in runs), 1),
        "matches_ar": (sum(checks) / len(checks)) if checks else None,
        "profile": {k: statistics.fmean(r["profile"][k] for r in runs if k in r["profile"]) for k in profile_keys},
    }


def summarise(runs: list[dict]) -> dict:
    """Per (task, temperature, mode) and per (prefill bucket, temperature, mode) aggregates."""

    def grouped(key_fields, selected):
        groups: dict[tuple, list[dict]] = defaultdict(list)
        for r in selected:
            groups[tuple(r[f] for f in key_fields)].append(r)
        return [dict(zip(key_fields, key), **_group_stats(rs)) for key, rs in groups.items()]

    runs = [dict(r, batch=r.get("batch", 1)) for r in runs]  # records from before batches were run
    by_task = grouped(("task", "batch", "temperature", "mode"), runs)
    ar_speed = {(g["task"], g["batch"], g["temperature"]): g["tokens_per_s"] for g in by_task if g["mode"] == "ar"}
    for g in by_task:
        ar = ar_speed.get((g["task"], g["batch"], g["temperature"]))
        g["speedup_vs_ar"] = g["tokens_per_s"] / ar if ar else None
    by_bucket = grouped(("bucket", "temperature", "mode"), [r for r in runs if r["bucket"] is not None])
    tau_change = {}
    for temperature, mode in {(g["temperature"], g["mode"]) for g in by_bucket}:
        rows = sorted(
            (g for g in by_bucket if (g["temperature"], g["mode"]) == (temperature, mode)),
            key=lambda g: g["mean_prompt_len"],
        )
        if len(rows) > 1 and rows[0]["mean_tau"] > 0:
            tau_change[f"{mode} T={temperature}"] = rows[-1]["mean_tau"] / rows[0]["mean_tau"] - 1.0
    return {"by_task": by_task, "by_bucket": by_bucket, "tau_change_shortest_to_longest_bucket": tau_change}


def _fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def markdown_tables(summary: dict) -> str:
    lines = [
        "| task | batch | T | mode | runs | tau | ms / round | tokens/s | speedup vs AR | greedy = AR |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for g in summary["by_task"]:
        lines.append(
            f"| {g['task']} | {g['batch']} | {g['temperature']:g} | {g['mode']} | {g['prompts']} | "
            f"{g['mean_tau']:.2f} | {g['ms_per_round']:.3f} | {g['tokens_per_s']:.1f} | "
            f"{_fmt(g['speedup_vs_ar'], '.2f')} | "
            f"{_fmt(g['matches_ar'], '.0%')} |"
        )
    if summary["by_bucket"]:
        lines += [
            "",
            "| prefill bucket | T | mode | prompts | mean prompt tokens | tau | tokens/s |",
            "| --- | --- | --- | --- | --- | --- | --- |",
        ]
        for g in sorted(summary["by_bucket"], key=lambda g: (g["temperature"], g["mode"], g["mean_prompt_len"])):
            lines.append(
                f"| {g['bucket']} | {g['temperature']:g} | {g['mode']} | {g['prompts']} | "
                f"{g['mean_prompt_len']:.0f} | {g['mean_tau']:.2f} | {g['tokens_per_s']:.1f} |"
            )
    return "\n".join(lines)


def _csv(text: str, cast, what: str) -> list:
    try:
        values = [cast(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values:
        raise UserError(f"{what} must be a comma-separated list, got {text!r}")
    return values


def load_models(
    target_path: str | None, draft_path: str | None, sampling_draft_path: str | None, dtype: str, want_draft: bool
):
    """(target, draft or None, sampling draft or None). Without --draft a target's shipped draft (the
    embedded SmolLM2's) is used; without --sampling-draft, --draft where given, else the target's
    shipped sampling draft."""
    import jax

    from longspec_jax.draft_io import inference_draft, sampling_draft_for
    from longspec_jax.target import load_target

    if dtype == "auto":
        dtype = "bfloat16" if jax.default_backend() == "gpu" else "float32"
    target = load_target(target_path, dtype=dtype)
    if not want_draft:
        return target, None, None
    draft = inference_draft(target, draft_path)
    given = None if sampling_draft_path is None else inference_draft(target, sampling_draft_path)
    return target, draft, sampling_draft_for(target, draft if draft_path is not None else None, given)


def build_parser() -> argparse.ArgumentParser:
    from longspec_jax.draft_head import HEAD_FORMATS
    from longspec_jax.int8_rows import BLOCK_FORMATS

    p = argparse.ArgumentParser(prog="python -m infer.benchmark", description=__doc__.splitlines()[0])
    p.add_argument("--eval-dir", type=Path, help="folder made by infer.build_eval_sets")
    p.add_argument("--target", help="HF directory or .gguf (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--draft", help="LongSpec draft (default for the embedded target: the shipped draft)")
    p.add_argument(
        "--sampling-draft",
        help="the draft of sampled runs (default: --draft where given, else the target's shipped sampling draft)",
    )
    p.add_argument(
        "--draft-head",
        choices=HEAD_FORMATS,
        default="auto",
        help="how the drafts read the LM head: int8 rows (half the bytes), the target's own, or auto "
        "(int8 for a head of 64 MiB or more)",
    )
    p.add_argument(
        "--draft-block",
        choices=BLOCK_FORMATS,
        default="auto",
        help="how the drafts hold their block's matrices: int8 rows (half the bytes), full (the dtype they "
        "run in), or auto (int8 for a block of 64 MiB or more)",
    )
    p.add_argument(
        "--modes",
        default="ar,pld,longspec",
        help="ar, pld, longspec, auto; pld:W-W-.. / longspec:W-W-.. run a chain or tree of their own",
    )
    p.add_argument("--temperatures", default="0,1")
    p.add_argument("--batch-sizes", default="1", help="e.g. 1,4,8: also run batches of consecutive prompts")
    p.add_argument("--tasks", default=",".join(TASKS))
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--limit", type=int, help="first N prompts per task (per bucket for prefill_length)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--attn-impl", help="xla, cudnn or pallas (default: fastest for the backend)")
    p.add_argument(
        "--ar-attn-impl",
        help="the AR baseline's attention (default: --attn-impl, i.e. what `--mode ar` runs)",
    )
    p.add_argument("--tree-widths", help="longspec's tree widths per depth, e.g. 4,16,16,16 (default 4,16,16,16,11)")
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="time each run this many times and keep the one of median decode time (noisy machines)",
    )
    p.add_argument(
        "--warm-up",
        type=int,
        help=f"untimed requests per mode and decode shape before its timed runs (default: {GPU_WARM_UP} on a "
        "GPU, where the first calls of a program build its command buffers; 1 elsewhere)",
    )
    p.add_argument(
        "--ignore-eos",
        action="store_true",
        help="make every run --max-new-tokens long (sampled batches then do equal work in every mode)",
    )
    p.add_argument("--dtype", choices=("auto", "bfloat16", "float32"), default="auto")
    p.add_argument("--profile", action="store_true", help="also time the parts of a decode step / round")
    p.add_argument("--json-out", type=Path, help="write the full results here")
    p.add_argument("--runs-out", type=Path, help="append each run here (jsonl) as it finishes")
    p.add_argument(
        "--resume",
        action="store_true",
        help="skip the runs already in --runs-out (an interrupted benchmark) and report them with the new",
    )
    p.add_argument(
        "--summarise",
        nargs="+",
        type=Path,
        metavar="RUNS_JSONL",
        help="build the tables from --runs-out files instead of running",
    )
    return p


def run(args: argparse.Namespace) -> dict:
    modes = _csv(args.modes, str, "--modes")
    mode_names = {parse_mode_spec(spec)[0] for spec in modes}  # a bad spec fails here, before loading
    temperatures = _csv(args.temperatures, float, "--temperatures")
    tasks = _csv(args.tasks, str, "--tasks")
    unknown = sorted(set(tasks) - set(TASKS))
    if unknown:
        raise UserError(f"unknown task(s) {', '.join(unknown)}: choose from {', '.join(TASKS)}")
    if args.repeats < 1:
        raise UserError(f"--repeats must be at least 1, got {args.repeats}")
    if args.warm_up is not None and args.warm_up < 1:
        raise UserError(f"--warm-up must be at least 1 (compilation must stay out of the timings), got {args.warm_up}")
    if args.resume and not args.runs_out:
        raise UserError("--resume continues the runs in --runs-out: pass --runs-out FILE too")
    from infer.generate import parse_tree_widths

    tree_widths = parse_tree_widths(args.tree_widths)
    manifest, items = load_eval_sets(args.eval_dir, tasks, args.limit)
    target, draft, sampling_draft = load_models(
        args.target, args.draft, args.sampling_draft, args.dtype, bool({"longspec", "auto"} & mode_names)
    )
    as_asked = {
        id(d): d.with_head_format(args.draft_head).with_block_format(args.draft_block)
        for d in (draft, sampling_draft)
        if d is not None
    }
    draft, sampling_draft = (d and as_asked[id(d)] for d in (draft, sampling_draft))  # one copy where one serves both
    if manifest.get("vocab_size") != target.config.vocab_size:
        raise UserError(
            f"the eval sets were tokenised with a {manifest.get('vocab_size')}-token vocabulary "
            f"({manifest.get('tokenizer')}) but the target has {target.config.vocab_size}: rebuild them "
            "with `python -m infer.build_eval_sets --tokenizer TARGET`"
        )
    import jax

    from longspec_jax import attention

    warm_up = args.warm_up or (GPU_WARM_UP if jax.default_backend() == "gpu" else 1)
    log = lambda message: print(message, file=sys.stderr, flush=True)  # noqa: E731
    ar_impl = args.ar_attn_impl
    done = _read_runs(args.runs_out) if args.resume and args.runs_out.is_file() else []
    if done:
        log(f"resuming: {len(done)} runs already in {args.runs_out}")
    runs_out = None
    if args.runs_out:
        args.runs_out.parent.mkdir(parents=True, exist_ok=True)
        runs_out = args.runs_out.open("a", encoding="utf-8")
    try:
        results = run_benchmark(
            target,
            draft,
            items,
            sampling_draft=sampling_draft,
            modes=modes,
            temperatures=temperatures,
            max_new_tokens=args.max_new_tokens,
            seed=args.seed,
            attn_impl=args.attn_impl,
            ar_attn_impl=ar_impl,
            tree_widths=tree_widths,
            profile=args.profile,
            log=log,
            on_run=None if runs_out is None else lambda r: (runs_out.write(json.dumps(r) + "\n"), runs_out.flush()),
            done=tuple(done),
            batch_sizes=_csv(args.batch_sizes, int, "--batch-sizes"),
            ignore_eos=args.ignore_eos,
            repeats=args.repeats,
            warm_up=warm_up,
        )
    finally:
        if runs_out is not None:
            runs_out.close()
    results["runs"] = done + results["runs"]
    summary = summarise(results["runs"])
    device = jax.devices()[0]
    return {
        "config": {
            "eval_dir": str(args.eval_dir),
            "target": args.target or "embedded SmolLM2-135M-Instruct",
            "draft": args.draft,
            "sampling_draft": args.sampling_draft,
            "dtype": str(target.dtype),
            "modes": modes,
            "temperatures": temperatures,
            "tasks": tasks,
            "tree_widths": tree_widths,
            "max_new_tokens": args.max_new_tokens,
            "ignore_eos": args.ignore_eos,
            "repeats": args.repeats,
            "warm_up": warm_up,
            "limit": args.limit,
            "seed": args.seed,
            "attn_impl": args.attn_impl or attention.default_impl(),
            "ar_attn_impl": ar_impl or args.attn_impl or attention.default_impl(),
            "backend": jax.default_backend(),
            "device": device.device_kind,
            "eval_manifest": manifest,
        },
        **results,
        "summary": summary,
        "markdown": markdown_tables(summary),
    }


def _read_runs(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def summarise_files(paths: list[Path]) -> dict:
    """The report's summary and tables from --runs-out files (one run per line)."""
    runs = []
    for path in paths:
        if not path.is_file():
            raise UserError(f"{path} does not exist: pass files written by --runs-out")
        runs += _read_runs(path)
    summary = summarise(runs)
    return {
        "config": {"runs_files": [str(p) for p in paths]},
        "runs": runs,
        "summary": summary,
        "markdown": markdown_tables(summary),
    }


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.summarise:
            report = summarise_files(args.summarise)
        elif args.eval_dir is None:
            raise UserError("pass --eval-dir (a folder made by infer.build_eval_sets) or --summarise RUNS.jsonl")
        else:
            report = run(args)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json_out:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps(report, indent=2) + "\n")
    print(report["markdown"])
    return 0 if report["runs"] else 1


if __name__ == "__main__":
    sys.exit(main())
