"""Training throughput: tokens/s, model FLOP utilisation and peak memory of the real training step
(`train.step`) for a random-weight Vicuna-7B-shaped target + its draft, at seq 1k and 16k, on 1 GPU
and sharded (FSDP) over 2 GPUs, with the 2-GPU / 1-GPU scaling ratio. Prints a table last.

    python -m benchmarks.bench_train              # on a GPU machine (each case in a fresh process)
    python -m benchmarks.bench_train --seqs 1024 --out train_1024.jsonl     # a subset per run, saved
    python -m benchmarks.bench_train --seqs 16384 --out train_16384.jsonl
    python -m benchmarks.bench_train --merge train_1024.jsonl train_16384.jsonl   # the table of both
    python -m benchmarks.bench_train --small      # CPU smoke test: tiny shapes, in one process

Each case runs in its own process under --case-timeout seconds (default 240: building the 7B
target, compiling its step and running it take minutes); its JSON line is printed (and appended to
--out) as soon as it ends, so a later case that times out loses nothing already measured. A case
reports its build, compile and warm-up seconds apart from the step time: 1 warm-up step (the first
run of the compiled step with donated buffers), then --steps timed ones.

Uses no data pipeline (random tokens, fresh each step), so it needs neither grain nor datasets.
MFU counts the step's useful matmul FLOPs (target forward without LM head and last attention/MLP;
draft forward + backward, its LM-head cross-entropy and attention, causal halves counted once)
against --peak-tflops (H200 SXM dense bf16: 989).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from longspec_jax.config import ModelConfig
from longspec_jax.draft import DraftBlock
from longspec_jax.errors import UserError
from longspec_jax.model import Transformer
from longspec_jax.model_shapes import MODEL_SHAPES
from train import sharding
from train.configs import tiny
from train.step import StepConfig, compile_step, init_state


@dataclasses.dataclass(frozen=True)
class Case:
    seq_len: int
    devices: int
    micro_batch: int  # sequences per device per step


def step_flops(model: ModelConfig, *, batch: int, seq_len: int, window: int = 512) -> float:
    """Useful matmul FLOPs of one training step (2 per multiply-add; causal attention counted half)."""
    h, f, v = model.hidden_size, model.intermediate_size, model.vocab_size
    qd, kvd = model.num_heads * model.head_dim, model.num_kv_heads * model.head_dim
    causal_attention = 2 * seq_len * qd  # QK^T and PV over on average L/2 keys
    target_layer = 2 * (h * (qd + 2 * kvd) + qd * h + 3 * h * f) + causal_attention
    target = (model.num_layers - 1) * target_layer + 2 * h * 2 * kvd
    draft_forward = (
        2 * (h * (qd + 2 * kvd) + qd * h)
        + 4 * min(window, seq_len) * qd  # windowed self-attention
        + 2 * (2 * h * qd)
        + causal_attention  # cross-attention
        + 2 * 3 * h * f
        + 2 * h * v
    )  # MLP and the LM head
    return batch * seq_len * (target + 3 * draft_forward)  # the draft's backward is twice its forward


def _random_module_state(make, mesh):
    """A module's parameters drawn on the devices directly in their planned shardings (a 7B host
    copy would be slow and, for bigger targets, not fit): norm weights 1, biases 0, other weights
    N(0, 0.02). One small program per distinct (shape, dtype, sharding): jitting the module's whole
    initialiser instead had XLA compile one 7B random-init program for over 200 s on the H200 (2026-11-30)."""
    graphdef, abstract = nnx.split(nnx.eval_shape(make))
    shardings = sharding.param_shardings(abstract, mesh)
    keys = iter(jax.random.split(jax.random.key(0), len(jax.tree.leaves(abstract))))

    def draw(path, leaf, leaf_sharding):
        names = [str(getattr(k, "key", getattr(k, "name", k))) for k in path]
        name = [n for n in names if n != "value"][-1]  # the Variable's own `.value` entry is not its name
        kind = "ones" if name == "weight" and leaf.ndim == 1 else "zeros" if name == "bias" else "normal"
        return _draw_leaf(kind, tuple(leaf.shape), jax.numpy.dtype(leaf.dtype), leaf_sharding)(next(keys))

    return graphdef, jax.tree_util.tree_map_with_path(draw, abstract, shardings)


@functools.cache
def _draw_leaf(kind: str, shape: tuple, dtype, leaf_sharding):
    def fn(key):
        if kind == "normal":
            return (0.02 * jax.random.normal(key, shape, jax.numpy.float32)).astype(dtype)
        return (jax.numpy.ones if kind == "ones" else jax.numpy.zeros)(shape, dtype)

    return jax.jit(fn, out_shardings=leaf_sharding)


def _progress(message: str) -> None:
    """A phase line on stderr: when a case is killed by its time limit, the last one says where."""
    print(f"# {message}", file=sys.stderr, flush=True)


def measure(model: ModelConfig, case: Case, *, steps: int, dtype: str, max_offset: int) -> dict:
    import optax

    t0 = time.perf_counter()
    mesh = sharding.make_mesh((1, -1, 1), jax.devices()[: case.devices])
    target_graphdef, target_params = _random_module_state(
        lambda: Transformer(model, dtype=dtype, rngs=nnx.Rngs(0)), mesh
    )
    draft_graphdef, draft_params = _random_module_state(lambda: DraftBlock(model, rngs=nnx.Rngs(1)), mesh)
    optimizer = optax.chain(
        optax.clip_by_global_norm(1.0), optax.adamw(1e-4, b1=0.9, b2=0.95, eps=1e-6, weight_decay=0.1)
    )
    state = init_state(nnx.to_pure_dict(draft_params), optimizer, mesh)
    jax.block_until_ready((target_params, state))
    build_s = time.perf_counter() - t0
    _progress(f"seq {case.seq_len}, {case.devices} device(s): target + draft built in {build_s:.1f} s")

    sc = StepConfig(
        gamma=5,
        anchor_offset=case.seq_len <= max_offset,
        num_anchors=4,
        max_offset=max_offset,
        compute_dtype=dtype,
        attn_impl=_attn_impl(),
        loss_chunk_tokens=1024,
    )
    rows = case.micro_batch * case.devices
    rng = np.random.default_rng(0)

    def fresh_batch():
        tokens = rng.integers(0, model.vocab_size, (1, rows, case.seq_len), dtype=np.int32)
        return jax.block_until_ready(sharding.global_batch({"tokens": tokens, "loss_mask": np.ones_like(tokens)}, mesh))

    t0 = time.perf_counter()
    step_fn = (
        compile_step(target_graphdef, draft_graphdef, optimizer, sc, mesh, target_params, state)
        .lower(target_params, state, fresh_batch(), jax.random.key(0))
        .compile()
    )
    compile_s = time.perf_counter() - t0
    _progress(f"step compiled in {compile_s:.1f} s")

    times = []
    for i in range(steps + 1):  # one warm-up step: the first run of the donated-buffer program
        batch = fresh_batch()
        start = time.perf_counter()
        state, metrics = step_fn(target_params, state, batch, jax.random.key(i))
        jax.block_until_ready((state, metrics))
        times.append(time.perf_counter() - start)
        _progress(f"step {i} ({'warm-up' if i == 0 else 'timed'}): {times[-1]:.3f} s")
    seconds = statistics.median(times[1:])
    tokens = rows * case.seq_len
    flops = step_flops(model, batch=rows, seq_len=case.seq_len)
    peak = [d.memory_stats().get("peak_bytes_in_use") for d in mesh.devices.flat if d.memory_stats()]
    return {
        "seq_len": case.seq_len,
        "devices": case.devices,
        "micro_batch": case.micro_batch,
        "device_kind": mesh.devices.flat[0].device_kind,
        "jax": jax.__version__,
        "dtype": dtype,
        "steps": steps,
        "step_s": seconds,
        "tokens_per_s": tokens / seconds,
        "tflops_per_device": flops / seconds / case.devices / 1e12,
        "peak_gb": max(peak) / 1e9 if peak else None,
        "loss": float(metrics["loss"]),
        "build_s": build_s,
        "compile_s": compile_s,
        "warmup_step_s": times[0],
    }


def _attn_impl() -> str:
    from longspec_jax import attention

    return attention.default_impl()


def run_with_limit(cmd: list[str], limit_s: float) -> tuple[int | None, str, str]:
    """(exit status, or None when killed at limit_s; stdout; stderr) of a child process."""
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=limit_s)
    except subprocess.TimeoutExpired as e:  # subprocess.run has killed the child
        decode = lambda b: b.decode(errors="replace") if isinstance(b, bytes) else (b or "")
        return None, decode(e.stdout), decode(e.stderr)
    return out.returncode, out.stdout, out.stderr


def _run_isolated(case: Case, args) -> dict:
    """One case in a fresh process under args.case_timeout, so its peak memory is its own. The
    parent never initialises the GPU itself: JAX would preallocate most of its memory and starve
    the child."""
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.bench_train",
        "--one",
        f"{case.seq_len},{case.devices},{case.micro_batch}",
        "--steps",
        str(args.steps),
    ]
    start = time.perf_counter()
    status, stdout, stderr = run_with_limit(cmd, args.case_timeout)
    failed = {"seq_len": case.seq_len, "devices": case.devices, "micro_batch": case.micro_batch}
    if status is None:
        phases = [line[2:] for line in stderr.splitlines() if line.startswith("# ")]
        last = f" (last: {phases[-1]})" if phases else " (before building the models)"
        return {**failed, "error": f"timed out after {args.case_timeout:.0f} s{last}"}
    if status:
        return {**failed, "error": " ".join(stderr.strip().splitlines()[-1:])}
    return {**json.loads(stdout.strip().splitlines()[-1]), "case_s": time.perf_counter() - start}


def table(results: list[dict], peak_tflops: float) -> str:
    lines = [
        "| seq | GPUs | seqs/step | step ms | tokens/s | TFLOP/s/GPU | MFU | peak GB | scaling | build s | compile s |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    single = {r["seq_len"]: r for r in results if r.get("devices") == 1 and "error" not in r}
    for r in results:
        if "error" in r:
            lines.append(f"| {r['seq_len']} | {r['devices']} | failed: {r['error'].replace('|', '/')} |||||||||")
            continue
        base = single.get(r["seq_len"])
        scaling = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x" if base and r["devices"] > 1 else "-"
        peak = "-" if r["peak_gb"] is None else f"{r['peak_gb']:.1f}"
        lines.append(
            f"| {r['seq_len']} | {r['devices']} | {r['micro_batch'] * r['devices']} | {r['step_s'] * 1e3:.1f} "
            f"| {r['tokens_per_s']:.0f} | {r['tflops_per_device']:.1f} | "
            f"{r['tflops_per_device'] / peak_tflops:.1%} | {peak} | {scaling} | {r['build_s']:.0f} "
            f"| {r['compile_s']:.0f} |"
        )
    return "\n".join(lines)


def print_report(results: list[dict], peak_tflops: float) -> None:
    """The header line and the table, sorted by sequence length then GPU count."""
    results = sorted(results, key=lambda r: (r["seq_len"], r["devices"]))
    done = [r for r in results if "error" not in r]
    described = sorted(
        {f"jax {r['jax']}, {r['device_kind']}, {r['dtype']}, median of {r['steps']} steps" for r in done}
    )
    print(f"# {'; '.join(described) or 'no case finished'}: random target + draft")
    print(table(results, peak_tflops))


def read_results(paths: list[str]) -> list[dict]:
    """The case lines (JSON objects with a seq_len) of saved outputs; a case measured again later
    (same seq and GPU count) replaces the earlier one."""
    by_case = {}
    for path in paths:
        if not Path(path).is_file():
            raise UserError(f"--merge {path}: no such file: pass the files an earlier run's --out wrote")
        for line in Path(path).read_text().splitlines():
            if not line.startswith("{"):
                continue
            record = json.loads(line)
            if "seq_len" in record:
                by_case[record["seq_len"], record["devices"]] = record
    if not by_case:
        raise UserError(f"--merge {' '.join(paths)}: no case lines found: pass the files an earlier run's --out wrote")
    return list(by_case.values())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--small", action="store_true", help="tiny shapes on CPU, all cases in this process")
    p.add_argument("--steps", type=int, default=5, help="timed steps per case (after one warm-up step)")
    p.add_argument("--seqs", default="1024,16384", help="sequence lengths (comma-separated)")
    p.add_argument(
        "--devices", default="1,2", help="GPU counts (comma-separated); counts above the available are skipped"
    )
    p.add_argument("--case-timeout", type=float, default=240.0, help="seconds one case (its own process) may take")
    p.add_argument("--out", help="also append each case's JSON line to this file (for --merge)")
    p.add_argument("--merge", nargs="+", metavar="FILE", help="only print the table of the case lines in these files")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="per-device peak for MFU (H200 bf16 dense)")
    p.add_argument("--one", help=argparse.SUPPRESS)  # internal: "seq,devices,micro" -> one JSON line
    args = p.parse_args(argv)
    try:
        if args.merge:
            print_report(read_results(args.merge), args.peak_tflops)
            return 0
        out_path = Path(args.out) if args.out else None
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    model = tiny.MODEL if args.small else MODEL_SHAPES["vicuna7b"]
    dtype = "float32" if args.small else "bfloat16"
    max_offset = 1024 if args.small else 15_000
    if args.one:
        seq, devices, micro = map(int, args.one.split(","))
        if devices > jax.device_count():
            print(json.dumps({"skipped": f"{devices} devices asked, {jax.device_count()} present"}))
        else:
            print(
                json.dumps(
                    measure(model, Case(seq, devices, micro), steps=args.steps, dtype=dtype, max_offset=max_offset)
                )
            )
        return 0
    seqs = [32] if args.small else [int(x) for x in args.seqs.split(",")]
    counts = [int(x) for x in args.devices.split(",")]
    # About 16k tokens per GPU per step (at least one sequence).
    cases = [Case(seq, n, 2 if args.small else max(1, 16384 // seq)) for seq in seqs for n in counts]
    results = []
    for case in cases:
        if args.small:  # in this process (the GPU path keeps the parent off the GPU: see _run_isolated)
            if case.devices > jax.device_count():
                continue
            result = measure(model, case, steps=args.steps, dtype=dtype, max_offset=max_offset)
        else:
            result = _run_isolated(case, args)
        if "skipped" in result:
            continue
        line = json.dumps(result)
        print(line, flush=True)
        if out_path:
            with out_path.open("a") as f:
                f.write(line + "\n")
        results.append(result)
    print_report(results, args.peak_tflops)
    return 0


if __name__ == "__main__":
    sys.exit(main())
