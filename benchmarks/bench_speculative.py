"""Per-round cost of LongSpec speculative decoding on 7B-shaped (and SmolLM2-shaped) random-weight targets (GPU).

    python -m benchmarks.bench_speculative                    # Vicuna-7B and Llama-3-8B shapes, bf16, 4k..64k
    python -m benchmarks.bench_speculative --small            # tiny config on CPU: a smoke test of this script

For each target shape and context S (tokens already in the target cache, zeros: attention and
matmul cost do not depend on the values) it times, with a random draft (bf16) and the default tree:
  - round: `decode_loop.decode` (the on-device while_loop `generate` uses) over --rounds
    rounds, per round;
  - draft / verify / accept: the round's three parts, each repeated --rounds times inside its own
    jitted program on the loop's state with the cache donated (updated in place, as in the loop;
    `round_profile.profile_round`), per repetition: the paper's Table 5 analogue. "parts" is their
    sum, printed next to the round so the two can be seen to agree (each part adds 1/--rounds of
    a launch and host sync, and loses fusion across its boundaries);
  - AR: the same loop in mode ar, per step at the same context.
Beside each time its floor (`benchmarks.floors`: each part's bytes at the memory rate and its matrix
work at the matmul rate, the longer of the two, both rates measured in the same run): the AR step's
and the verify's (the products' weights and the cache's K/V; the verify's 64 rows a sequence make
its attention bound by the matrix work at a GQA model's long context), and the draft's (per level
the block's weights, the shared LM head and the target's last-layer K/V it cross-attends). The
round's floor is the draft's and the verify's together: "fl r/AR", that floor against the AR step's,
is the round / AR ratio this design can reach at best. --no-parts times the round and the AR step
only (the parts' columns read nan): a row compiles and runs two loops instead of five programs.
--trace DIR also records one more run of each loop under the profiler and prints where its GPU time
goes per round (or step) by kernel class and the kernels that took most (`trace_round`'s summary).
The target runs in its inference layout (packed q|k|v and gate|up, as `Generator` decodes);
--fused-projections also runs its projections as fused Pallas kernels (with --impl pallas).
--candidate-tokens all,32768, --draft-heads auto,target and --draft-blocks auto,full time the round
once per draft vocabulary, format of the draft's LM head (draft_head.py: "auto" reads a 7B head as
int8, "target" as the target's own rows) and format of its block (int8_rows.py: "auto" holds a 7B
draft's matrices as int8, "full" in the dtype it runs in) in one process; the table's "cands"
column names each.
Random weights accept almost nothing, so tokens per round are not measured here; the table gives
the PROJECTED speedup of a round emitting tau tokens (--tau, default 3.5, the paper's ~3.5 for 7B
targets): AR ms/token / (round ms / tau). Round cost does not depend on acceptance (static shapes).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gzip
import itertools
import json
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from benchmarks import floors
from benchmarks.decode_kernels import with_vocabulary
from benchmarks.trace_round import print_summary, print_top, summarise
from longspec_jax import model as model_module
from longspec_jax.attention import CACHE_ROW_TILE, IMPLS, default_impl
from longspec_jax.config import ModelConfig
from longspec_jax.decode_kit import StopRule, bucket_length, cache_bytes, compiled, timed
from longspec_jax.decode_loop import LoopConfig, decode, start, started
from longspec_jax.draft import DraftConfig
from longspec_jax.draft_head import HEAD_FORMATS, check_head_format
from longspec_jax.draft_io import init_draft
from longspec_jax.int8_rows import BLOCK_FORMATS, check_block_format
from longspec_jax.model import init_cache
from longspec_jax.model_shapes import timing_shape
from longspec_jax.proposers import NoProposal, proposer_for
from longspec_jax.round_profile import profile_round
from longspec_jax.sampling import SamplingParams
from longspec_jax.target import random_target
from longspec_jax.tree import DEFAULT_WIDTHS, lookup_widths, num_nodes

SHAPES = {
    "vicuna7b": timing_shape("vicuna7b", 131072),
    "llama3_8b": timing_shape("llama31_8b", 131072),  # Llama-3-8B and 3.1 differ only in RoPE scaling
    "smollm2_135m": timing_shape("smollm2_135m", 131072),  # the embedded target's shape
    "tiny": ModelConfig(
        model_type="llama",
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        max_position_embeddings=4096,
    ),
}


@dataclasses.dataclass
class Row:
    shape: str
    context: int
    candidates: str = "all"  # the draft's candidate tokens (all, or how many) and a head format but auto
    round_ms: float = float("nan")
    draft_ms: float = float("nan")
    verify_ms: float = float("nan")
    accept_ms: float = float("nan")
    parts_sum_ms: float = float("nan")
    ar_ms: float = float("nan")
    ar_floor_ms: float = float("nan")
    verify_floor_ms: float = float("nan")
    draft_floor_ms: float = float("nan")
    draft_cache_mib: float = float("nan")
    error: str = ""


def loop_state(target, params, proposer_params, *, context, batch, config, slack, sampling, stop):
    """The loop's state with `context` tokens in the target cache (as after a prefill of that many);
    the cache's rows rounded up to whole 128-row tiles (`attention.CACHE_ROW_TILE`), as a generator's
    cache is where the GPU has no room for a power of two."""
    rows = -(-(context + config.new_bucket + slack) // CACHE_ROW_TILE) * CACHE_ROW_TILE
    cache = init_cache(target.config, batch, rows, target.dtype)
    prompt = jnp.zeros((batch, context), jnp.int32)
    lengths = jnp.full((batch,), context, jnp.int32)
    cache = cache.replace(lengths=jnp.full((batch,), context, jnp.int32))
    last_logits = jnp.zeros((batch, target.config.vocab_size), jnp.float32)
    args = (params, proposer_params, cache, prompt, lengths, last_logits, sampling, jax.random.key(0), stop)
    run_start, _ = compiled(start, *args, config=config)
    return started(run_start, *args)


def traced(trace_dir: Path | None, label: str, run, make, steps: int, top: int = 25) -> None:
    """One more run of `run` on a fresh state under the profiler, summarised per round (or step)."""
    if trace_dir is None:
        return
    state = make()
    with jax.profiler.trace(str(trace_dir / label), create_perfetto_trace=True):
        jax.block_until_ready(run(state))
    del state
    trace = json.load(gzip.open(max((trace_dir / label).glob("**/perfetto_trace.json.gz"))))
    print_summary(label, summarise(trace, steps))
    print_top(trace, steps, top)


def bench_longspec(
    target,
    graphdef,
    params,
    draft,
    *,
    context,
    batch,
    widths,
    rounds,
    repeats,
    impl,
    trace_dir=None,
    lookup_tokens=0,
    parts=True,
):
    """(ms per round in the loop, {draft_ms, verify_ms, accept_ms, parts_sum_ms}, draft state bytes);
    lookup_tokens > 0: the tree with a prompt-lookup chain of that many tokens beside it; parts
    False: the parts not timed (NaN), their three programs neither compiled nor run."""
    sampling = SamplingParams.create(0.0)
    stop = StopRule.create((), 2**30)  # never reached: every run makes exactly `rounds` rounds
    # Room for the timed loop's rounds and for profile_round's 2 (1 + rounds) rounds, each from a fresh state.
    most_rounds = 2 * (rounds + 1)
    proposer, draft_params = proposer_for("longspec", target, draft, widths, lookup_tokens=lookup_tokens)
    widths = proposer.widths  # with a lookup chain, the combined tree's
    config = LoopConfig(graphdef, proposer, bucket_length((most_rounds + 1) * (len(widths) + 1)), impl)
    make = lambda: loop_state(
        target,
        params,
        draft_params,
        context=context,
        batch=batch,
        config=config,
        slack=num_nodes(widths),
        sampling=sampling,
        stop=stop,
    )
    stop_at = jnp.asarray(rounds, jnp.int32)
    state = make()
    draft_bytes = proposer.cache_bytes(state.proposal)  # its arrays' sizes: the same in every state
    run_decode, _ = compiled(decode, params, draft_params, state, stop_at, sampling, config=config)
    per_round = []
    for _ in range(repeats + 1):  # the first run warms up
        state, seconds = timed(run_decode, params, draft_params, state if not per_round else make(), stop_at, sampling)
        per_round.append(seconds / rounds)
        del state
    traced(
        trace_dir, f"round_{context}", lambda st: run_decode(params, draft_params, st, stop_at, sampling), make, rounds
    )
    if parts:
        times, _ = profile_round(config, params, draft_params, make(), sampling, repeats=rounds)
    else:
        times = dict.fromkeys(("draft_ms", "verify_ms", "accept_ms", "parts_sum_ms"), float("nan"))
    return 1e3 * statistics.median(per_round[1:]), times, draft_bytes


def bench_ar(target, graphdef, params, *, context, batch, steps, repeats, impl, trace_dir=None):
    """ms per AR step inside the device loop."""
    sampling = SamplingParams.create(0.0)
    stop = StopRule.create((), 2**30)
    config = LoopConfig(graphdef, NoProposal(), bucket_length(steps + 2), impl)
    make = lambda: loop_state(
        target, params, (), context=context, batch=batch, config=config, slack=0, sampling=sampling, stop=stop
    )
    stop_at = jnp.asarray(steps, jnp.int32)
    state = make()
    run_decode, _ = compiled(decode, params, (), state, stop_at, sampling, config=config)
    per_step = []
    for _ in range(repeats + 1):
        state, seconds = timed(run_decode, params, (), state if not per_step else make(), stop_at, sampling)
        per_step.append(seconds / steps)
        del state
    traced(trace_dir, f"ar_{context}", lambda st: run_decode(params, (), st, stop_at, sampling), make, steps)
    return 1e3 * statistics.median(per_step[1:])


def main(argv: list[str] | None = None) -> list[Row]:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_speculative", description=__doc__.splitlines()[0])
    p.add_argument("--small", action="store_true", help="tiny config on CPU (smoke test)")
    p.add_argument("--shapes", help=f"comma-separated target shapes of {sorted(SHAPES)} (default vicuna7b,llama3_8b)")
    p.add_argument("--contexts", help="comma-separated contexts (default 4096,16384,32768,65536; --small 64,256)")
    p.add_argument("--tree-widths", default=",".join(map(str, DEFAULT_WIDTHS)))
    p.add_argument(
        "--impl",
        choices=IMPLS,
        help="attention implementation for target and draft (default: what decoding runs on this backend)",
    )
    p.add_argument("--rounds", type=int, help="rounds (and AR steps) per timing (default 32; --small 3)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs after a warm-up")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--tau", type=float, default=3.5, help="tokens per round assumed for the projected speedup")
    p.add_argument("--fused-projections", action="store_true", help="the target's projections as fused Pallas kernels")
    p.add_argument(
        "--candidate-tokens",
        default="all",
        help="comma-separated draft vocabularies, a round timed with each: all, or N (the first N token ids)",
    )
    p.add_argument(
        "--draft-heads",
        default="auto",
        help=f"comma-separated formats of the draft's LM head ({', '.join(HEAD_FORMATS)}), a round timed with each",
    )
    p.add_argument(
        "--draft-blocks",
        default="auto",
        help=f"comma-separated formats of the draft's block ({', '.join(BLOCK_FORMATS)}), a round timed with each",
    )
    p.add_argument(
        "--int8-products",
        default=model_module.INT8_PRODUCTS,
        help="comma-separated ways an int8 draft block's products run on a GPU (xla: XLA's GEMM, the default; "
        "kernel: fused_linear), a round timed with each",
    )
    p.add_argument(
        "--no-parts",
        action="store_true",
        help="time the round and the AR step only, not the draft, verify and accept programs "
        "(a row then compiles and runs two loops instead of five programs)",
    )
    p.add_argument("--trace", type=Path, help="also trace one run of each loop here and print where its time goes")
    p.add_argument(
        "--lookup-tokens",
        type=int,
        default=0,
        help="time the tree with a prompt-lookup chain of this many tokens beside it",
    )
    args = p.parse_args(argv)
    args.impl = args.impl or default_impl()
    shapes = ["tiny"] if args.small else (args.shapes or "vicuna7b,llama3_8b").split(",")
    contexts = [int(c) for c in (args.contexts or ("64,256" if args.small else "4096,16384,32768,65536")).split(",")]
    widths = tuple(int(w) for w in args.tree_widths.split(","))
    rounds = args.rounds or (3 if args.small else 32)
    dtype = "float32" if args.small else "bfloat16"
    heads = [check_head_format(h) for h in args.draft_heads.split(",")]
    blocks = [check_block_format(b) for b in args.draft_blocks.split(",")]
    routes = args.int8_products.split(",")
    if not set(routes) <= {"xla", "kernel"}:
        raise SystemExit(f"--int8-products: {args.int8_products!r}: choose among xla, kernel")

    print(
        f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC | {jax.devices()[0].device_kind} "
        f"| jax {jax.__version__}"
    )
    rates = floors.measure_rates(small=args.small)
    print(f"floors at {rates.bandwidth / 1e9:.0f} GB/s and {rates.matmul / 1e12:.0f} TFLOP/s (bf16 matmul)")
    rows = []
    model_route = model_module.INT8_PRODUCTS  # the model's own, back once every row is timed
    for shape in shapes:
        t0 = time.perf_counter()
        target = random_target(SHAPES[shape], dtype=dtype)
        draft = init_draft(target, seed=1, config=DraftConfig()).cast(target.dtype)
        model = target.decode_model()  # the packed inference layout, as Generator decodes
        model.fused_projections = args.fused_projections
        graphdef, params = nnx.split(model)
        jax.block_until_ready(params)
        print(
            f"{shape}: {cache_bytes(params) / 1e9:.2f} GB of target weights, "
            f"draft {cache_bytes(nnx.state(draft.block)) / 1e9:.2f} GB "
            f"(random, built in {time.perf_counter() - t0:.0f} s)"
        )
        for context in contexts:
            ar_ms = float("nan")
            for vocabulary, head_format, block_format, route in itertools.product(
                args.candidate_tokens.split(","), heads, blocks, routes
            ):
                cut = with_vocabulary(draft, vocabulary).with_head_format(head_format).with_block_format(block_format)
                formats = [head_format] * (head_format != "auto") + [f"block-{block_format}"] * (block_format != "auto")
                formats += [f"{route}-products"] * (len(routes) > 1)
                if route != model_module.INT8_PRODUCTS:  # the route is chosen when a program is traced
                    model_module.INT8_PRODUCTS = route
                    jax.clear_caches()
                row = Row(shape, context, "/".join([vocabulary, *formats]))
                row.ar_floor_ms = 1e3 * floors.step_seconds(model, 1, context, args.batch, rates)
                row.draft_floor_ms = 1e3 * floors.draft_round_seconds(model, cut, widths, context, args.batch, rates)
                verified = num_nodes(lookup_widths(widths, args.lookup_tokens))  # the tree's rows and the root
                row.verify_floor_ms = 1e3 * floors.step_seconds(model, verified, context, args.batch, rates)
                try:
                    row.round_ms, parts, draft_bytes = bench_longspec(
                        target,
                        graphdef,
                        params,
                        cut,
                        context=context,
                        batch=args.batch,
                        widths=widths,
                        rounds=rounds,
                        repeats=args.repeats,
                        impl=args.impl,
                        trace_dir=args.trace and args.trace / shape / row.candidates.replace("/", "_"),
                        lookup_tokens=args.lookup_tokens,
                        parts=not args.no_parts,
                    )
                    row.draft_ms, row.verify_ms = parts["draft_ms"], parts["verify_ms"]
                    row.accept_ms, row.parts_sum_ms = parts["accept_ms"], parts["parts_sum_ms"]
                    row.draft_cache_mib = draft_bytes / 2**20
                    if ar_ms != ar_ms:  # once a context: the AR step does not depend on the draft
                        ar_ms = bench_ar(
                            target,
                            graphdef,
                            params,
                            context=context,
                            batch=args.batch,
                            steps=rounds,
                            repeats=args.repeats,
                            impl=args.impl,
                            trace_dir=args.trace and args.trace / shape,
                        )
                    row.ar_ms = ar_ms
                except Exception as e:  # out of memory at a long context is a row, not a crash
                    row.error = f"{type(e).__name__}: {str(e).splitlines()[0][:100]}"
                rows.append(row)
                print(row, flush=True)
        del target, draft, params

    model_module.INT8_PRODUCTS = model_route
    print(
        f"\nLongSpec round vs AR step, batch {args.batch}, tree {widths}"
        + (f" with a prompt-lookup chain of {args.lookup_tokens} tokens" if args.lookup_tokens else "")
        + f", attention {args.impl}, "
        f"{rounds} rounds per timing, median of {args.repeats}. "
        f"PROJECTED speedup = AR ms / (round ms / tau), tau = {args.tau} assumed, not measured."
    )
    print("parts = draft + verify + accept as separate in-place programs, per round: it should be close to round ms.")
    print(
        "fl: the floor beside each time (benchmarks.floors); ver/AR: the verify against the AR step; "
        "fl r/AR: the round's floor (draft + verify) against the AR step's."
    )
    print(
        f"{'shape':<13}{'context':>8}{'cands':>20}{'round ms':>10}{'parts':>8}{'draft':>8}{'dr fl':>7}{'dr/fl':>7}"
        f"{'verify':>8}{'ver fl':>8}{'ver/fl':>7}{'ver/AR':>7}{'accept':>8}{'AR ms':>8}{'AR fl':>7}{'AR/fl':>7}"
        f"{'rnd/AR':>8}{'fl r/AR':>8}{'AR tok/s':>10}{'proj. x':>9}{'draft MiB':>11}"
    )
    for r in rows:
        if r.error:
            print(f"{r.shape:<13}{r.context:>8}{r.candidates:>20}  failed: {r.error}")
            continue
        round_floor = r.draft_floor_ms + r.verify_floor_ms
        print(
            f"{r.shape:<13}{r.context:>8}{r.candidates:>20}{r.round_ms:>10.2f}{r.parts_sum_ms:>8.2f}{r.draft_ms:>8.2f}"
            f"{r.draft_floor_ms:>7.2f}{r.draft_ms / r.draft_floor_ms:>7.2f}"
            f"{r.verify_ms:>8.2f}{r.verify_floor_ms:>8.2f}{r.verify_ms / r.verify_floor_ms:>7.2f}"
            f"{r.verify_ms / r.ar_ms:>7.2f}{r.accept_ms:>8.2f}"
            f"{r.ar_ms:>8.2f}{r.ar_floor_ms:>7.2f}{r.ar_ms / r.ar_floor_ms:>7.2f}"
            f"{r.round_ms / r.ar_ms:>8.2f}{round_floor / r.ar_floor_ms:>8.2f}{1e3 * args.batch / r.ar_ms:>10.1f}"
            f"{r.ar_ms * args.tau / r.round_ms:>9.2f}{r.draft_cache_mib:>11.1f}"
        )
    return rows


if __name__ == "__main__":
    main()
