"""Training throughput: tokens/s, model FLOP utilisation and peak memory of the real training step
(`train.step`) for a random-weight Vicuna-7B-shaped target + its draft, at seq 1k and 16k, on 1 GPU
and sharded (FSDP) over 2 GPUs, with the 2-GPU / 1-GPU scaling ratio. Prints a table last.

    python -m train.bench_train              # on the GPU machine (each case in a fresh process)
    python -m train.bench_train --seqs 16384 --devices 2   # a subset (each case compiles a 7B step)
    python -m train.bench_train --small      # CPU smoke test: tiny shapes, in one process

Uses no data pipeline (random tokens, fresh each step), so it needs neither grain nor datasets.
MFU counts the step's useful matmul FLOPs (target forward without LM head and last attention/MLP;
draft forward + backward, its LM-head cross-entropy and attention, causal halves counted once)
against --peak-tflops (H200 SXM dense bf16: 989).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import time

import jax
import numpy as np
from flax import nnx

from longspec_jax.config import ModelConfig
from longspec_jax.draft import DraftBlock
from longspec_jax.model import Transformer
from train import sharding
from train.configs import tiny, vicuna7b
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
    draft_forward = (2 * (h * (qd + 2 * kvd) + qd * h) + 4 * min(window, seq_len) * qd  # windowed self-attention
                     + 2 * (2 * h * qd) + causal_attention  # cross-attention
                     + 2 * 3 * h * f + 2 * h * v)  # MLP and the LM head
    return batch * seq_len * (target + 3 * draft_forward)  # the draft's backward is twice its forward


def _random_module_state(make, mesh):
    """A module's parameters drawn on the devices directly in their planned shardings (a 7B host
    copy would be slow and, for bigger targets, not fit)."""
    graphdef, abstract = nnx.split(nnx.eval_shape(make))
    shardings = sharding.param_shardings(abstract, mesh)
    state = jax.jit(lambda: nnx.split(make())[1], out_shardings=shardings)()
    return graphdef, state


def measure(model: ModelConfig, case: Case, *, steps: int, dtype: str, max_offset: int) -> dict:
    import optax

    mesh = sharding.make_mesh((1, -1, 1), jax.devices()[: case.devices])
    target_graphdef, target_params = _random_module_state(
        lambda: Transformer(model, dtype=dtype, rngs=nnx.Rngs(0)), mesh)
    draft_graphdef, draft_params = _random_module_state(lambda: DraftBlock(model, rngs=nnx.Rngs(1)), mesh)
    optimizer = optax.chain(optax.clip_by_global_norm(1.0),
                            optax.adamw(1e-4, b1=0.9, b2=0.95, eps=1e-6, weight_decay=0.1))
    state = init_state(nnx.to_pure_dict(draft_params), optimizer, mesh)
    sc = StepConfig(gamma=5, anchor_offset=case.seq_len <= max_offset, num_anchors=4, max_offset=max_offset,
                    compute_dtype=dtype, attn_impl=_attn_impl(), loss_chunk_tokens=1024)
    step_fn = compile_step(target_graphdef, draft_graphdef, optimizer, sc, mesh, target_params, state)
    rows = case.micro_batch * case.devices
    rng = np.random.default_rng(0)

    def fresh_batch():
        tokens = rng.integers(0, model.vocab_size, (1, rows, case.seq_len), dtype=np.int32)
        return sharding.global_batch({"tokens": tokens, "loss_mask": np.ones_like(tokens)}, mesh)

    times = []
    for i in range(steps + 2):  # two warm-up steps: compile, then the first donated-buffer run
        batch = fresh_batch()
        jax.block_until_ready(batch)
        start = time.perf_counter()
        state, metrics = step_fn(target_params, state, batch, jax.random.key(i))
        jax.block_until_ready((state, metrics))
        if i >= 2:
            times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    tokens = rows * case.seq_len
    flops = step_flops(model, batch=rows, seq_len=case.seq_len)
    peak = [d.memory_stats().get("peak_bytes_in_use") for d in mesh.devices.flat if d.memory_stats()]
    return {"seq_len": case.seq_len, "devices": case.devices, "micro_batch": case.micro_batch,
            "device_kind": mesh.devices.flat[0].device_kind,
            "step_s": seconds, "tokens_per_s": tokens / seconds, "tflops_per_device": flops / seconds / case.devices / 1e12,
            "peak_gb": max(peak) / 1e9 if peak else None, "loss": float(metrics["loss"])}


def _attn_impl() -> str:
    from longspec_jax import attention

    return attention.default_impl()


def _run_isolated(case: Case, args) -> dict:
    """One case in a fresh process, so its peak memory is its own. The parent never initialises
    the GPU itself: JAX would preallocate most of its memory and starve the child."""
    cmd = [sys.executable, "-m", "train.bench_train", "--one", f"{case.seq_len},{case.devices},{case.micro_batch}",
           "--steps", str(args.steps)]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode:
        return {"seq_len": case.seq_len, "devices": case.devices, "error": out.stderr.strip().splitlines()[-1:]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def table(results: list[dict], peak_tflops: float) -> str:
    lines = ["| seq | GPUs | seqs/step | step ms | tokens/s | TFLOP/s/GPU | MFU | peak GB | scaling |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    single = {r["seq_len"]: r for r in results if r.get("devices") == 1 and "error" not in r}
    for r in results:
        if "error" in r:
            lines.append(f"| {r['seq_len']} | {r['devices']} | failed: {' '.join(r['error'])} |||||||")
            continue
        base = single.get(r["seq_len"])
        scaling = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x" if base and r["devices"] > 1 else "-"
        peak = "-" if r["peak_gb"] is None else f"{r['peak_gb']:.1f}"
        lines.append(f"| {r['seq_len']} | {r['devices']} | {r['micro_batch'] * r['devices']} | {r['step_s'] * 1e3:.1f} "
                     f"| {r['tokens_per_s']:.0f} | {r['tflops_per_device']:.1f} | "
                     f"{r['tflops_per_device'] / peak_tflops:.1%} | {peak} | {scaling} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--small", action="store_true", help="tiny shapes on CPU, all cases in this process")
    p.add_argument("--steps", type=int, default=5, help="timed steps per case (after two warm-up steps)")
    p.add_argument("--seqs", default="1024,16384", help="sequence lengths (comma-separated)")
    p.add_argument("--devices", default="1,2", help="GPU counts (comma-separated); counts above the available are skipped")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="per-device peak for MFU (H200 bf16 dense)")
    p.add_argument("--one", help=argparse.SUPPRESS)  # internal: "seq,devices,micro" -> one JSON line
    args = p.parse_args(argv)
    model = tiny.MODEL if args.small else vicuna7b.MODEL
    dtype = "float32" if args.small else "bfloat16"
    max_offset = 1024 if args.small else 15_000
    if args.one:
        seq, devices, micro = map(int, args.one.split(","))
        if devices > jax.device_count():
            print(json.dumps({"skipped": f"{devices} devices asked, {jax.device_count()} present"}))
        else:
            print(json.dumps(measure(model, Case(seq, devices, micro), steps=args.steps, dtype=dtype, max_offset=max_offset)))
        return 0
    seqs = [32] if args.small else [int(x) for x in args.seqs.split(",")]
    counts = [int(x) for x in args.devices.split(",")]
    # About 16k tokens per GPU per step (at least one sequence).
    cases = [Case(seq, n, 2 if args.small else max(1, 16384 // seq)) for seq in seqs for n in counts]
    results = []
    for case in cases:
        if args.small:  # in this process (the GPU path keeps the parent off the GPU: see _run_isolated)
            if case.devices <= jax.device_count():
                results.append(measure(model, case, steps=args.steps, dtype=dtype, max_offset=max_offset))
        else:
            results.append(_run_isolated(case, args))
    results = [r for r in results if "skipped" not in r]
    kinds = sorted({r["device_kind"] for r in results if "device_kind" in r})
    print(f"# jax {jax.__version__}, {', '.join(kinds)}, {'tiny' if args.small else 'Vicuna-7B'} "
          f"target + draft, {dtype}, median of {args.steps} steps")
    print(table(results, args.peak_tflops))
    return 0


if __name__ == "__main__":
    sys.exit(main())
