"""The verify's attention over the cache on the GPU: the Triton split-K kernel against the Mosaic GPU
one (TMA and wgmma), per layer, against their floor measured in the same run: the K/V bytes at the
better of a copy's and a reduction's rate, or the matrix work (4 T Hq D context FLOPs) at a large bf16
matmul's rate, whichever is longer.

Both kernels take T = 64 queries (the default tree's 63 nodes and the root) against keys
[0, context) of a cache; each time includes the merge of the partials (split_combine's kernel for
both). Beside them, the Triton verify kernel (RoPE, the cache and the tree's own keys under its
mask, the K/V writes, then the combine) and the verify's attention as the model runs it ("model
verify": on a Hopper GPU, where `attention.cache_on_hopper_units` takes the shape, the kernel that
rotates and writes the rows, then the Mosaic GPU kernel with the tree's own keys; else that Triton
kernel), to show what the verify pays beyond the cache. Timed in a device loop whose iteration calls
the kernel once per layer, each layer with its own cache, each call's output the next call's
queries. Correctness against float64 first, at shapes off the tile grid.

One layer is the default: with eight, the loop holding the Mosaic GPU kernel did not finish in
minutes on the H200 (not understood yet). With one, a cache smaller than the L2 (60 MB; at 4k
tokens) stays there between iterations, so only contexts whose cache is several times the L2 read
from memory as the model does.

    python -m benchmarks.bench_cache_attention
    python -m benchmarks.bench_cache_attention --shapes vicuna7b --contexts 32768 --batches 1 \
        --mgpu-configs 128:2:auto,64:3:auto,64:4:16
"""

from __future__ import annotations

import argparse
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import floors
from longspec_jax.attention import attend_and_write_block
from longspec_jax.decode_kit import timed
from longspec_jax.model_shapes import MODEL_SHAPES
from longspec_jax.rope import inverse_frequencies, rope_tables
from pallas_kernels import cache_attention as triton_cache
from pallas_kernels import cache_attention_mgpu as mgpu_cache
from pallas_kernels import hybrid_attention as pallas_hybrid
from pallas_kernels.reference import attention_reference, cache_visibility, random_tree_mask

warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated")

T = mgpu_cache.QUERY_ROWS
ITERATIONS = 20
# (B, Hq, Hkv, D, capacity, lengths) checked against float64: lengths off the tile grid, an empty
# sequence, GQA, both head dims.
CHECKS = [(2, 32, 8, 128, 4224, [4133, 0]), (1, 32, 32, 128, 1024, [1000]), (3, 9, 3, 64, 8192, [4500, 64, 7000])]


def parse_config(text: str) -> dict:
    """ "block_keys:stages:splits" (splits "auto": the kernel's default)."""
    block_keys, stages, splits = text.split(":")
    return dict(block_keys=int(block_keys), stages=int(stages), num_splits=None if splits == "auto" else int(splits))


def check(configs) -> None:
    rng = np.random.default_rng(0)
    for b, hq, hkv, d, capacity, lengths in CHECKS:
        q = jnp.asarray(rng.standard_normal((b, T, hq, d)), jnp.bfloat16)
        k = jnp.asarray(rng.standard_normal((b, capacity, hkv, d)), jnp.bfloat16)
        v = jnp.asarray(rng.standard_normal((b, capacity, hkv, d)), jnp.bfloat16)
        lens = jnp.asarray(lengths, jnp.int32)
        ref_o, ref_lse = attention_reference(q, k, v, cache_visibility(lengths, T, capacity))
        for name, fn in [("triton", triton_cache.cache_attention)] + [
            (f"mgpu {c}", lambda *a, c=c: mgpu_cache.cache_attention(*a, **parse_config(c))) for c in configs
        ]:
            try:
                o, lse = fn(q, k, v, lens)
            except Exception as e:  # a configuration that does not compile is reported, not fatal
                print(f"check B={b} Hq={hq} Hkv={hkv} D={d} {name}: FAILED {type(e).__name__}: {str(e)[:2000]}")
                continue
            o_err = float(np.abs(np.asarray(o, np.float64) - ref_o).max())
            finite = np.isfinite(ref_lse)
            lse_err = float(np.abs(np.asarray(lse, np.float64)[finite] - ref_lse[finite]).max())
            empty_ok = bool(np.all(np.isneginf(np.asarray(lse)[~finite])))
            status = "ok" if o_err < 2e-2 and lse_err < 1e-2 and empty_ok else "WRONG"
            print(f"check B={b} Hq={hq} Hkv={hkv} D={d} {lengths} {name}: o {o_err:.2e} lse {lse_err:.2e} {status}")


def best_seconds(fn, arg, repeats: int) -> float:
    """The fastest of `repeats` timed calls of fn(arg), after one to compile and warm up."""
    timed(fn, arg)
    return min(timed(fn, arg)[1] for _ in range(repeats))


def layer_seconds(attend, q, caches, lengths) -> float:
    """Seconds per call of attend(q, k_cache, v_cache, lengths) -> (o, k_cache, v_cache), one call
    per layer in a device loop, the caches carried (a kernel that writes them does so in place)."""
    layers = len(caches) // 2

    def body(_, carry):
        q, caches = carry
        new = []
        for i in range(layers):
            q, k, v = attend(q, caches[2 * i], caches[2 * i + 1], lengths)
            new += [k, v]
        return q, tuple(new)

    run = jax.jit(lambda carry: jax.lax.fori_loop(0, ITERATIONS, body, carry), donate_argnums=0)
    state = [(jnp.copy(q), tuple(jnp.copy(c) for c in caches))]  # donated to the loop: the caller's stay valid

    def step(_):
        state[0] = run(state[0])
        return state[0][0]

    return best_seconds(step, None, repeats=3) / ITERATIONS / layers


def cache_only(kernel):
    """A cache kernel as an attender: the caches pass through unchanged."""
    return lambda q, k, v, lengths: (kernel(q, k, v, lengths)[0], k, v)


def parse_verify_config(text: str) -> dict:
    """ "block_rows:warps:stages" of the verify kernel, or "auto" (the launch the model uses)."""
    if text == "auto":
        return {}
    block_rows, warps, stages = map(int, text.split(":"))
    return dict(block_rows=block_rows, num_warps=warps, num_stages=stages)


def verify_inputs(config, batch: int, context: int):
    """What a verify's attention takes beside q and the caches: fixed new keys and values
    [B,T,Hkv,D], RoPE's (cos, sin) at rows [context, context + T), and a random tree mask."""
    hkv, d = config.num_kv_heads, config.head_dim
    key_k, key_v = jax.random.split(jax.random.key(1))
    new_k = jax.random.normal(key_k, (batch, T, hkv, d), jnp.bfloat16)
    new_v = jax.random.normal(key_v, (batch, T, hkv, d), jnp.bfloat16)
    positions = context + jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (batch, T))
    rope = rope_tables(positions, jnp.asarray(inverse_frequencies(config)))
    mask = jnp.asarray(random_tree_mask(np.random.default_rng(0), batch, T))
    return new_k, new_v, rope, mask


def verify_kernel(config, batch: int, context: int, launch: dict):
    """The model's verify kernel as an attender: RoPE, the cache and the tree's own keys under a
    random tree mask, their K/V written at rows [context, context + T). Its q|k|v input is the
    queries with fixed new keys and values appended (one small XLA concatenation a call)."""
    new_k, new_v, (cos, sin), mask = verify_inputs(config, batch, context)
    cos, sin = cos.reshape(batch, T, -1), sin.reshape(batch, T, -1)

    def attend(q, k_cache, v_cache, lengths):
        qkv = jnp.concatenate([q, new_k, new_v], axis=2)
        return pallas_hybrid.hybrid_attention_and_write(
            qkv, cos, sin, k_cache, v_cache, lengths, mask, num_heads=config.num_heads, **launch
        )

    return attend


def model_verify(config, batch: int, context: int):
    """The verify's attention as the model runs it (`attention.attend_and_write_block`, impl
    "pallas": the Mosaic GPU route where `attention.cache_on_hopper_units` takes the shape, else the
    Triton kernel), from the same inputs as `verify_kernel`."""
    new_k, new_v, rope, mask = verify_inputs(config, batch, context)

    def attend(q, k_cache, v_cache, lengths):
        qkv = jnp.concatenate([q, new_k, new_v], axis=2).reshape(batch, T, -1)
        return attend_and_write_block(
            qkv, rope, k_cache, v_cache, lengths, mask, num_heads=config.num_heads, impl="pallas"
        )

    return attend


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="vicuna7b,llama31_8b")
    parser.add_argument("--contexts", default="32768")
    parser.add_argument("--batches", default="1,4")
    parser.add_argument("--layers", type=int, default=1, help="caches cycled through per loop iteration")
    parser.add_argument("--mgpu-configs", default="128:2:auto,64:3:auto", help="block_keys:stages:splits,...")
    parser.add_argument(
        "--verify-configs",
        default="auto",
        help='block_rows:warps:stages,... of the verify kernel ("auto": the model\'s)',
    )
    parser.add_argument("--skip-check", action="store_true")
    args = parser.parse_args(argv)
    configs = [c for c in args.mgpu_configs.split(",") if c]
    verify_configs = args.verify_configs.split(",")
    print(
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} | {jax.devices()[0].device_kind} | jax {jax.__version__}"
    )
    if not args.skip_check:
        check(configs)
    rates = floors.measure_rates()
    rate, matmul_rate = rates.bandwidth, rates.matmul
    print(f"read rate {rate / 1e9:.0f} GB/s, bf16 matmul {matmul_rate / 1e12:.0f} TFLOP/s")
    print(
        "| shape | B | context | K/V MB | GFLOP | floor us | triton cache us | "
        + "".join(f"triton verify {c} us | " for c in verify_configs)
        + "".join(f"mgpu {c} us | " for c in configs)
        + "model verify us |"
    )
    for shape in args.shapes.split(","):
        config = MODEL_SHAPES[shape]
        hq, hkv, d = config.num_heads, config.num_kv_heads, config.head_dim
        for context in map(int, args.contexts.split(",")):
            for batch in map(int, args.batches.split(",")):
                keys = jax.random.split(jax.random.key(context + batch), 2 * args.layers + 1)
                q = jax.random.normal(keys[0], (batch, T, hq, d), jnp.bfloat16)
                # Room for the verify kernel's writes, in whole 128-key tiles.
                capacity = context + 128
                caches = tuple(jax.random.normal(k, (batch, capacity, hkv, d), jnp.bfloat16) for k in keys[1:])
                lengths = jnp.full((batch,), context, jnp.int32)
                kv_bytes = 2 * batch * context * hkv * d * 2
                flops = 4 * batch * T * hq * d * context
                floor = max(kv_bytes / rate, flops / matmul_rate)
                floor_kind = "bytes" if kv_bytes / rate >= flops / matmul_rate else "flops"
                started = time.perf_counter()
                attenders = (
                    [
                        ("triton cache", cache_only(triton_cache.cache_attention)),
                    ]
                    + [
                        (f"triton verify {c}", verify_kernel(config, batch, context, parse_verify_config(c)))
                        for c in verify_configs
                    ]
                    + [
                        (
                            f"mgpu {c}",
                            cache_only(lambda *a, knobs=parse_config(c): mgpu_cache.cache_attention(*a, **knobs)),
                        )
                        for c in configs
                    ]
                    + [("model verify", model_verify(config, batch, context))]
                )
                times = []
                for name, attend in attenders:
                    try:
                        times.append(layer_seconds(attend, q, caches, lengths))
                        print(f"  {shape} B={batch} {context} {name} {times[-1] * 1e6:.1f} us")
                    except Exception as e:  # a configuration that does not compile is reported, not fatal
                        print(f"  {shape} B={batch} {context} {name}: FAILED {type(e).__name__}: {str(e)[:300]}")
                        times.append(float("nan"))
                print(f"  ({time.perf_counter() - started:.0f} s for this row)")
                cells = " | ".join(f"{s * 1e6:.1f} ({s / floor:.2f}x)" for s in times)
                print(
                    f"| {shape} | {batch} | {context} | {kv_bytes / 1e6:.0f} | {flops / 1e9:.1f} | "
                    f"{floor * 1e6:.1f} ({floor_kind}) | {cells} |"
                )
                del caches


if __name__ == "__main__":
    main()
