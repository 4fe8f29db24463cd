"""Times the draft's head top-k kernel (`head_top_k`) over a head at a few launch settings, on the GPU.

For a head of V x H (Llama-3: 128,256 x 4,096; Vicuna-7B: 32,000 x 4,096; the embedded SmolLM2's
draft's cut head: 16,400 x 576) and rows 1 and 16 (a tree level's nodes), k = 16 (--k; a smaller k
shows what the kernel's k rounds of selection cost), each setting is timed over the head in each of
--formats (int8 with a float32 scale a row, as draft_head.py holds a 7B's; bf16, the target's rows)
by `bench_draft_top_k.loop_us`: its calls inside one device loop (each call's input depends on the
previous result), best of three; us per call. A setting is (tokens per program, warps, pipeline
stages, features of H a step loads); None is the kernel's default. --settings times only the given
ones, each as block_vocab:warps:stages:block_h with "-" for a default. Each row also gives the
pass's floor at the rates this process measures (`floors.Rates.seconds`: the head read once, or its
matrix work if longer) and the time against it. --groups G ranks the rows under Gumbel noise of
G groups, as a batch of G sequences' tree level does (64 rows, 4 groups: a batch of four's level).

    python -m benchmarks.tune_head_top_k [--shapes 128256x4096,32000x4096] [--rows 1,16] [--k 16]
        [--formats int8,bf16] [--settings 256:-:3:-,128:4:3:-] [--groups 4]
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp

from benchmarks.bench_draft_top_k import loop_us
from benchmarks.floors import measure_rates
from longspec_jax.decode_kit import cache_bytes
from longspec_jax.int8_rows import quantized_rows
from pallas_kernels.head_top_k import head_top_k

# (block_vocab, num_warps, num_stages, block_h)
SETTINGS = [
    (256, None, 3, None),
    (256, 8, 3, None),
    (256, 4, 4, None),
    (128, 4, 3, None),
    (128, 8, 3, None),
    (512, 8, 3, None),
    (256, 8, 4, None),
    (256, 4, 2, 256),
    (128, 4, 3, 256),
    (128, 4, 4, 256),
    (64, 4, 4, 256),
]


def parse_settings(text: str) -> list[tuple]:
    """--settings' text, e.g. 256:-:3:-,128:4:3:256 -> [(256, None, 3, None), (128, 4, 3, 256)]."""
    settings = []
    for item in text.split(","):
        fields = item.split(":")
        if len(fields) != 4:
            raise SystemExit(f"--settings: {item!r} is not block_vocab:warps:stages:block_h (use - for a default)")
        try:
            settings.append(tuple(None if f == "-" else int(f) for f in fields))
        except ValueError:
            raise SystemExit(f"--settings: {item!r} holds a field that is neither a whole number nor -") from None
    return settings


def main(argv=None) -> list[tuple]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="128256x4096,32000x4096", help="VOCABxHIDDEN, comma-separated")
    parser.add_argument("--rows", default="1,16")
    parser.add_argument("--k", type=int, default=16, help="candidates a row")
    parser.add_argument("--settings", help="only these, as block_vocab:warps:stages:block_h,... (- for a default)")
    parser.add_argument("--formats", default="int8", help="the head's formats, of int8 and bf16 (comma-separated)")
    parser.add_argument(
        "--groups",
        type=int,
        default=0,
        help="rank the rows under Gumbel noise of this many groups (a batch's sequences; each count of "
        "--rows a multiple of it); 0: no noise",
    )
    args = parser.parse_args(argv)
    settings = SETTINGS if args.settings is None else parse_settings(args.settings)
    formats = args.formats.split(",")
    if not set(formats) <= {"int8", "bf16"}:
        raise SystemExit(f"--formats: {args.formats!r} names a format other than int8 and bf16")
    rates = measure_rates()
    print("vocab rows format block_vocab warps stages block_h us floor_us us/floor", flush=True)
    results = []
    for shape in args.shapes.split(","):
        vocab, hidden = (int(x) for x in shape.split("x"))
        head = jax.random.normal(jax.random.key(0), (vocab, hidden), jnp.bfloat16) * 0.05
        rows8, scale = quantized_rows(head)
        heads = {"bf16": {"head": head}, "int8": {"head": rows8, "head_scale": scale}}
        for rows in (int(r) for r in args.rows.split(",")):
            if args.groups and rows % args.groups:
                raise SystemExit(f"--rows: {rows} rows do not fall into --groups {args.groups} equal groups")
            x = jax.random.normal(jax.random.key(rows), (rows, hidden), jnp.bfloat16)
            noise = jax.random.gumbel(jax.random.key(rows + 1), (args.groups, vocab)) if args.groups else None
            for head_format in formats:
                floor_us = rates.seconds(cache_bytes(heads[head_format]), 2 * rows * vocab * hidden) * 1e6
                for block_vocab, warps, stages, block_h in settings:
                    knobs = dict(block_vocab=block_vocab, num_warps=warps, num_stages=stages, block_h=block_h)
                    top_k = functools.partial(head_top_k, k=args.k, noise=noise, **heads[head_format], **knobs)
                    try:
                        us = loop_us(top_k, x)
                    except Exception as err:  # a setting the compiler refuses is a row, not a crash
                        us = f"fail {type(err).__name__}"
                    row = (vocab, rows, head_format, block_vocab, warps, stages, block_h, us)
                    results.append(row)
                    shown = (
                        (us,) if isinstance(us, str) else (round(us, 1), round(floor_us, 1), round(us / floor_us, 2))
                    )
                    print(*row[:-1], *shown, flush=True)
    return results


if __name__ == "__main__":
    main()
