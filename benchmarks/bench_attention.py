"""GPU benchmark of verify attention: checks correctness on the GPU first, then times

  (a) xla_dense:           XLA dense masked attention over the concatenated keys (the "HF eager" analogue)
  (b) cudnn_masked:        cuDNN with an explicit mask over the concatenated keys
  (c) hybrid_cudnn:        cuDNN cache path + Pallas masked kernel + LSE merge
  (d) hybrid_pallas:       the fused Pallas kernel (split-K over the cache, the new keys one more
                           split) + the Pallas combine: two kernels
  (e) hybrid_pallas_parts: Pallas split-K cache path + Pallas masked kernel + LSE merge (what (d)
                           replaced)

at 7B shapes (Hq = 32, D = 128, bf16), against the floor max(K/V bytes read once / copy bandwidth,
FLOPs / matmul rate), both ceilings measured in the same run. The new tokens' K/V sit right after
the cache, as in the model, so (a) and (b) read one concatenated array prepared outside the timing.

    python -m benchmarks.bench_attention   # S = 4k..128k, T = 74/16/128, B = 1/4, Hkv = 32/8
    python -m benchmarks.bench_attention --seq-lens 32768 --tree-sizes 74 --tune

Each time is the median over groups of back-to-back calls (after compile and warm-up), cycling
through independently drawn input sets so no call finds its K/V in L2 from the previous one. The
full table goes to $OUT/bench_attention.md when OUT (or --out) is set; a short table prints last.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import floors
from longspec_jax import attention
from pallas_kernels import cache_attention as pallas_cache
from pallas_kernels import hybrid_attention as pallas_hybrid
from pallas_kernels.reference import attention_reference, cache_visibility, random_tree_mask
from pallas_kernels.tree_attention import masked_attention

warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated")

HQ, D = 32, 128
DTYPE = jnp.bfloat16
# Input sets cycled through while timing: together at least this many bytes, several times the
# H200's 60 MB L2, so a call never finds its K/V cached by the previous one.
CYCLE_BYTES = 256 << 20
# (B, T, Hkv, S, cache lengths) checked against float64 before any timing: lengths off the tile
# grid, an empty sequence, T = 1.
CHECK_SHAPES = [(2, 74, 8, 4133, [4133, 1234]), (3, 128, 32, 1100, [0, 1100, 77]), (1, 1, 8, 2048, [2048])]
METHODS = ("xla_dense", "cudnn_masked", "hybrid_cudnn", "hybrid_pallas", "hybrid_pallas_parts")
HYBRIDS = ("hybrid_cudnn", "hybrid_pallas", "hybrid_pallas_parts")
# Split-K configurations tried by --tune (block_rows, block_keys, num_warps, num_stages, num_splits).
TUNE_CONFIGS = [
    dict(block_rows=128, block_keys=64, num_warps=8, num_stages=3),
    dict(block_rows=128, block_keys=64, num_warps=8, num_stages=4),
    dict(block_rows=128, block_keys=128, num_warps=8, num_stages=3),
    dict(block_rows=128, block_keys=64, num_warps=4, num_stages=3),
    dict(block_rows=64, block_keys=128, num_warps=4, num_stages=3),
    dict(block_rows=64, block_keys=64, num_warps=4, num_stages=3),
    dict(block_rows=32, block_keys=128, num_warps=4, num_stages=3),
]


def log(*parts):
    print(*parts, flush=True)


# ---------------------------------------------------------------- the four methods


def xla_dense(q, k_all, v_all, mask_all):
    return attention.masked_softmax_attention(q, k_all, v_all, mask_all)[0]


def cudnn_masked(q, k_all, v_all, mask_all):
    return jax.nn.dot_product_attention(q, k_all, v_all, mask=mask_all[:, None], implementation="cudnn")


def hybrid(q, k_cache, v_cache, cache_len, k_new, v_new, tree_mask, *, impl):
    return attention.hybrid_tree_attention(q, k_cache, v_cache, cache_len, k_new, v_new, tree_mask, impl=impl)


def hybrid_pallas_config(q, k_cache, v_cache, cache_len, k_new, v_new, tree_mask, *, config):
    """(d) with an explicit split-K configuration (what --tune compares)."""
    return pallas_hybrid.hybrid_attention(q, k_cache, v_cache, cache_len, k_new, v_new, tree_mask, **config)


def hybrid_pallas_parts(q, k_cache, v_cache, cache_len, k_new, v_new, tree_mask, *, config):
    """(e): the cache kernel with the same split-K configuration, the masked kernel, the XLA merge."""
    o_c, lse_c = pallas_cache.cache_attention(q, k_cache, v_cache, cache_len, **config)
    o_s, lse_s = masked_attention(q, k_new, v_new, tree_mask)
    return attention.merge_attention(o_c, lse_c, o_s, lse_s)


# ---------------------------------------------------------------- inputs


def input_set_count(b, t, hkv, s) -> int:
    set_bytes = 2 * 2 * b * (s + t) * hkv * D * 2  # K, V for the hybrid and again concatenated
    return int(min(8, max(2, -(-CYCLE_BYTES // set_bytes))))


def make_inputs(key, b, t, hkv, s, cache_len=None, tree=True):
    """One input set: hybrid args and the concatenated-key args of the same problem."""
    kq, kk, kv, kn, kvn, km = jax.random.split(key, 6)
    q = jax.random.normal(kq, (b, t, HQ, D), DTYPE)
    k_cache = jax.random.normal(kk, (b, s, hkv, D), DTYPE)
    v_cache = jax.random.normal(kv, (b, s, hkv, D), DTYPE)
    k_new = jax.random.normal(kn, (b, t, hkv, D), DTYPE)
    v_new = jax.random.normal(kvn, (b, t, hkv, D), DTYPE)
    rng = np.random.default_rng(int(jax.random.randint(km, (), 0, 2**31 - 1)))
    tree_mask = random_tree_mask(rng, b, t) if tree else rng.random((b, t, t)) < 0.5
    cache_len = np.full((b,), s, np.int32) if cache_len is None else np.asarray(cache_len, np.int32)
    hybrid_args = (q, k_cache, v_cache, jnp.asarray(cache_len), k_new, v_new, jnp.asarray(tree_mask))
    mask_all = np.concatenate([cache_visibility(cache_len, t, s), tree_mask], axis=-1)
    dense_args = (q, jnp.concatenate([k_cache, k_new], 1), jnp.concatenate([v_cache, v_new], 1), jnp.asarray(mask_all))
    return hybrid_args, dense_args


# ---------------------------------------------------------------- correctness on the GPU


def relative_error(got, want):
    got = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))


def lse_error(got, want):
    got = np.asarray(got, np.float64)
    same_inf = np.array_equal(np.isneginf(got), np.isneginf(want)) and not np.isnan(got).any()
    finite = np.isfinite(want)
    return float(np.max(np.abs(got[finite] - want[finite]))) if same_inf else float("inf")


def check_correctness(best_config) -> bool:
    """Every method and both kernels against a float64 reference of the same bf16 inputs."""
    ok = True
    for b, t, hkv, s, lengths in CHECK_SHAPES:
        hyb, dense = make_inputs(jax.random.key(100 + t), b, t, hkv, s, lengths, tree=(t != 128))
        host = [np.asarray(jnp.asarray(x, jnp.float32)) if x.dtype == DTYPE else np.asarray(x) for x in hyb]
        q, kc, vc, cl, kn, vn, tm = host
        want_o, _ = attention_reference(q, dense[1].astype(jnp.float32), dense[2].astype(jnp.float32), dense[3])
        want_o_c, want_lse_c = attention_reference(q, kc, vc, cache_visibility(cl, t, s))
        want_o_s, want_lse_s = attention_reference(q, kn, vn, tm)
        # name -> (function, its arguments, whether it returns (o, lse) rather than o)
        runs = {
            "hybrid_xla": (functools.partial(hybrid, impl="xla"), hyb, False),
            "hybrid_cudnn": (functools.partial(hybrid, impl="cudnn"), hyb, False),
            "hybrid_pallas": (functools.partial(hybrid, impl="pallas"), hyb, False),
            "hybrid_pallas_tuned": (functools.partial(hybrid_pallas_config, config=best_config), hyb, False),
            "hybrid_pallas_parts": (functools.partial(hybrid_pallas_parts, config=best_config), hyb, False),
            "cache_pallas": (functools.partial(attention.cache_attention, impl="pallas"), hyb[:4], True),
            "cache_cudnn": (functools.partial(attention.cache_attention, impl="cudnn"), hyb[:4], True),
            "masked_pallas": (masked_attention, (hyb[0], hyb[4], hyb[5], hyb[6]), True),
        }
        if 0 not in lengths:  # an empty cache leaves fully masked rows, undefined for cuDNN's mask path
            runs["cudnn_masked"] = (cudnn_masked, dense, False)
        for name, (fn, args, with_lse) in runs.items():
            try:
                out = jax.jit(fn)(*args)
            except Exception as err:  # reported as a failed check; the timing still runs
                log(f"  check {name}: failed {type(err).__name__}: {str(err)[:300]}")
                ok = False
                continue
            o, lse = out if with_lse else (out, None)
            if name.startswith("cache"):
                err_o, err_lse = relative_error(o, want_o_c), lse_error(lse, want_lse_c)
            elif name.startswith("masked"):
                err_o, err_lse = relative_error(o, want_o_s), lse_error(lse, want_lse_s)
            else:
                err_o, err_lse = relative_error(o, want_o), 0.0
            good = err_o < 2e-2 and err_lse < 2e-2
            ok &= good
            log(
                f"  check B={b} T={t} Hkv={hkv} S={s} lens={lengths} {name:20s} "
                f"rel_err(o)={err_o:.2e} abs_err(lse)={err_lse:.2e} {'PASS' if good else 'FAIL'}"
            )
    return check_prefill() and ok


def check_prefill(b=2, length=300, hkv=8, lengths=(300, 123)) -> bool:
    """prefill_attention's cuDNN path (also what impl "pallas" runs) on valid rows vs float64."""
    kq, kk, kv = jax.random.split(jax.random.key(7), 3)
    q = jax.random.normal(kq, (b, length, HQ, D), DTYPE)
    k = jax.random.normal(kk, (b, length, hkv, D), DTYPE)
    v = jax.random.normal(kv, (b, length, hkv, D), DTYPE)
    lengths = np.asarray(lengths, np.int32)
    pos = np.arange(length)
    mask = (pos[None, :, None] >= pos[None, None, :]) & (pos[None, None, :] < lengths[:, None, None])
    want, _ = attention_reference(*(np.asarray(x.astype(jnp.float32)) for x in (q, k, v)), mask)
    valid = pos[None, :] < lengths[:, None]
    ok = True
    for impl in ("cudnn", "pallas"):
        try:
            got = jax.jit(functools.partial(attention.prefill_attention, impl=impl))(q, k, v, jnp.asarray(lengths))
            err = relative_error(np.asarray(got.astype(jnp.float32))[valid], want[valid])
        except Exception as err_:  # reported as a failed check; the timing still runs
            log(f"  check prefill {impl}: failed {type(err_).__name__}: {str(err_)[:300]}")
            ok = False
            continue
        ok &= err < 2e-2
        log(
            f"  check prefill B={b} L={length} Hkv={hkv} lens={lengths.tolist()} {impl:8s} rel_err(o)={err:.2e} "
            f"{'PASS' if err < 2e-2 else 'FAIL'}"
        )
    return ok


# ---------------------------------------------------------------- tuning and the table


def tune(t, s, hkv, b):
    """Time every TUNE_CONFIGS entry of (d) at one shape; returns (best config, [(config, seconds)])."""
    sets = [make_inputs(jax.random.key(i), b, t, hkv, s)[0] for i in range(input_set_count(b, t, hkv, s))]
    timings = []
    for config in TUNE_CONFIGS:
        fn = jax.jit(functools.partial(hybrid_pallas_config, config=config))
        try:
            sec = floors.time_call(fn, sets)
        except Exception as err:  # a config Triton rejects is reported, not fatal
            log(f"  tune {config}: failed {type(err).__name__}: {str(err)[:200]}")
            continue
        timings.append((config, sec))
        log(f"  tune B={b} T={t} S={s} Hkv={hkv} {config}: {sec * 1e3:.3f} ms")
    best = min(timings, key=lambda x: x[1])[0] if timings else TUNE_CONFIGS[0]
    return best, timings


def bench_shape(b, t, hkv, s, bandwidth, flops_rate, configs, breakdown=False):
    """One table row: seconds per method (None when it failed) plus the floor."""
    sets = [make_inputs(jax.random.key(1000 * i + t), b, t, hkv, s) for i in range(input_set_count(b, t, hkv, s))]
    hyb_sets = [h for h, _ in sets]
    dense_sets = [d for _, d in sets]
    fns = {
        "xla_dense": (jax.jit(xla_dense), dense_sets),
        "cudnn_masked": (jax.jit(cudnn_masked), dense_sets),
        "hybrid_cudnn": (jax.jit(functools.partial(hybrid, impl="cudnn")), hyb_sets),
        "hybrid_pallas": (jax.jit(functools.partial(hybrid_pallas_config, config=configs[b, hkv])), hyb_sets),
        "hybrid_pallas_parts": (jax.jit(functools.partial(hybrid_pallas_parts, config=configs[b, hkv])), hyb_sets),
    }
    if breakdown:
        fns["part_cache_cudnn"] = (
            jax.jit(functools.partial(attention.cache_attention, impl="cudnn")),
            [h[:4] for h in hyb_sets],
        )
        fns["part_cache_pallas"] = (
            jax.jit(functools.partial(pallas_cache.cache_attention, **configs[b, hkv])),
            [h[:4] for h in hyb_sets],
        )
        fns["part_masked_pallas"] = (jax.jit(masked_attention), [(h[0], h[4], h[5], h[6]) for h in hyb_sets])
    row = {}
    for name, (fn, args) in fns.items():
        try:
            row[name] = floors.time_call(fn, args)
        except Exception as err:
            log(f"  {name} B={b} T={t} Hkv={hkv} S={s}: failed {type(err).__name__}: {str(err)[:300]}")
            row[name] = None
    kv_bytes = 2 * b * (s + t) * hkv * D * 2 + 2 * b * t * HQ * D * 2  # K+V once, q in, o out
    flops = 4 * b * t * HQ * D * (s + t)
    row["floor"] = max(kv_bytes / bandwidth, flops / flops_rate)
    row["floor_kind"] = "bytes" if kv_bytes / bandwidth >= flops / flops_rate else "flops"
    del sets, hyb_sets, dense_sets
    return row


def format_table(rows):
    extra = sorted({k for r in rows for k in r["times"] if k.startswith("part_")})
    head = (
        "| B | Hkv | S | T | "
        + " | ".join(f"{m} ms" for m in METHODS + tuple(extra))
        + " | floor ms | best hybrid / floor | (a) / best hybrid |"
    )
    lines = [head, "|" + " --- |" * (head.count("|") - 1)]
    for r in rows:
        tm = r["times"]
        cells = [
            f"{tm[m] * 1e3:.3f}" if tm.get(m) else ("-" if m not in tm else "fail") for m in METHODS + tuple(extra)
        ]
        hybrids = [tm[m] for m in HYBRIDS if tm.get(m)]
        best = min(hybrids) if hybrids else None
        ratio = f"{best / tm['floor']:.2f}x" if best else "-"
        speed = f"{tm['xla_dense'] / best:.2f}x" if best and tm.get("xla_dense") else "-"
        lines.append(
            f"| {r['b']} | {r['hkv']} | {r['s']} | {r['t']} | "
            + " | ".join(cells)
            + f" | {tm['floor'] * 1e3:.3f} ({tm['floor_kind']}) | {ratio} | {speed} |"
        )
    return "\n".join(lines)


def target_verdicts(rows):
    """The attention targets at T = 74, S = 32k: best hybrid <= 1.5x floor and >= 4x faster than (a)."""
    out = []
    for r in rows:
        if r["t"] != 74 or r["s"] != 32768:
            continue
        tm = r["times"]
        hybrids = {m: tm[m] for m in HYBRIDS if tm.get(m)}
        if not hybrids:
            out.append(f"B={r['b']} Hkv={r['hkv']}: no hybrid ran")
            continue
        name, best = min(hybrids.items(), key=lambda x: x[1])
        vs_floor = best / tm["floor"]
        line = (
            f"B={r['b']} Hkv={r['hkv']} T=74 S=32k: best {name} {best * 1e3:.3f} ms = {vs_floor:.2f}x floor "
            f"(target <= 1.5x: {'MET' if vs_floor <= 1.5 else f'MISSED by {vs_floor / 1.5:.2f}x'})"
        )
        if tm.get("xla_dense"):
            speed = tm["xla_dense"] / best
            line += (
                f"; {speed:.2f}x faster than xla_dense (target >= 4x: "
                f"{'MET' if speed >= 4 else f'MISSED by {4 / speed:.2f}x'})"
            )
        out.append(line)
    return out


def parse_ints(text):
    return [int(x) for x in text.split(",") if x]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-lens", default="4096,16384,32768,65536,131072")
    parser.add_argument("--tree-sizes", default="74,16,128", help="outermost loop, first one first")
    parser.add_argument("--batches", default="1,4")
    parser.add_argument("--kv-heads", default="32,8")
    parser.add_argument(
        "--tune",
        action="store_true",
        help="pick the split-K config of (d) per (B, Hkv) at T=74, S=32k (else the library default)",
    )
    parser.add_argument("--budget-s", type=float, default=1e9, help="stop adding table rows after this")
    parser.add_argument("--out", default=os.environ.get("OUT"))
    args = parser.parse_args(argv)
    started = time.perf_counter()
    if jax.default_backend() != "gpu":
        sys.exit("bench_attention times GPU kernels: run it on a machine with an NVIDIA GPU")
    device = jax.devices()[0]
    log(f"device {device.device_kind}, jax {jax.__version__}, default_impl={attention.default_impl()}")

    rates = floors.measure_rates()
    bandwidth, flops_rate = rates.bandwidth, rates.matmul
    log(f"ceilings: bandwidth {bandwidth / 1e12:.2f} TB/s, bf16 matmul {flops_rate / 1e12:.0f} TFLOP/s")

    batches, kv_heads = parse_ints(args.batches), parse_ints(args.kv_heads)
    configs = {(b, hkv): {} for b in batches for hkv in kv_heads}  # {} = the library defaults
    tuning = {}
    if args.tune:
        for key in configs:
            configs[key], tuning[key] = tune(74, 32768, key[1], key[0])
            log(f"  best split-K config for B={key[0]} Hkv={key[1]}: {configs[key]}")

    correct = check_correctness(configs[batches[0], kv_heads[0]])
    log(f"correctness on GPU: {'ALL PASS' if correct else 'SOME FAILED'} ({time.perf_counter() - started:.0f} s)")

    rows, skipped = [], []
    for t in parse_ints(args.tree_sizes):
        for b in batches:
            for hkv in kv_heads:
                for s in parse_ints(args.seq_lens):
                    if time.perf_counter() - started > args.budget_s:
                        skipped.append(f"B={b} Hkv={hkv} T={t} S={s}")
                        continue
                    times = bench_shape(
                        b, t, hkv, s, bandwidth, flops_rate, configs, breakdown=(t == 74 and s == 32768)
                    )
                    rows.append(dict(b=b, hkv=hkv, t=t, s=s, times=times))
                    log(
                        f"  B={b} Hkv={hkv} T={t} S={s}: "
                        + ", ".join(f"{k}={v * 1e3:.3f}ms" for k, v in times.items() if isinstance(v, float))
                    )
    if skipped:
        log(f"time budget reached; not measured: {'; '.join(skipped)}")

    table = format_table(rows)
    verdicts = target_verdicts(rows)
    report = [
        f"device {device.device_kind}; jax {jax.__version__}; bandwidth {bandwidth / 1e12:.2f} TB/s; "
        f"matmul {flops_rate / 1e12:.0f} TFLOP/s; correctness {'PASS' if correct else 'FAIL'}",
        f"split-K configs of (d) per (B, Hkv), {{}} = library defaults: {configs}",
        "",
        table,
        "",
        *verdicts,
        *([f"not measured (time budget): {'; '.join(skipped)}"] if skipped else []),
    ]
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "bench_attention.md"), "w") as f:
            f.write("\n".join(report) + "\n")
        with open(os.path.join(args.out, "bench_attention.json"), "w") as f:
            json.dump(
                dict(
                    rows=rows,
                    configs={str(k): v for k, v in configs.items()},
                    tuning={str(k): v for k, v in tuning.items()},
                    bandwidth=bandwidth,
                    flops_rate=flops_rate,
                    correct=correct,
                ),
                f,
                indent=1,
            )
    log("\n".join(report))


if __name__ == "__main__":
    main()
