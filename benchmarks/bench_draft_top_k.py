"""A draft step's LM head and top-k: the logits, log-softmax and `tree.vocab_top_k` (XLA) against
the fused Pallas kernel (`draft.draft_top_k`, impl "pallas"), on the GPU.

For a head of V x H (SmolLM2: 49,152 x 576; Llama-3: 128,256 x 4,096, bfloat16), rows 1 to 64 (a
tree level's nodes times the batch) and k = 4 and 16, each call is timed inside a device loop (so
no host dispatch is in the figure), beside the floor: the head's bytes at the memory rate measured
in the same run (`floors.measure_rates`; the rows' matrix work never binds here). The two paths'
token ids are compared first (equal where the k-th and (k+1)-th log-probs are apart by more than
rounding). The kernel also runs over the head's int8 rows (draft_head.py: a scale a row, half the
bytes), beside the share of its top-k ids that equal the bfloat16 head's.

    python -m benchmarks.bench_draft_top_k [--shapes 49152x576,128256x4096]
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import floors
from longspec_jax.draft import draft_top_k
from longspec_jax.draft_head import DraftHead
from longspec_jax.int8_rows import quantized_rows

ITERATIONS = 200


def loop_us(top_k, features) -> float:
    """Microseconds per top_k(features) -> (best, ids) call, timed as ITERATIONS calls in one device
    loop (each call's input depends on the previous result, so none is hoisted or overlapped)."""

    def body(_, carry):
        x, total = carry
        best, ids = top_k(x)
        first, first_id = best.reshape(-1)[0], ids.reshape(-1)[0]
        nudge = (first * 1e-30 + first_id.astype(jnp.float32) * 1e-30).astype(x.dtype)
        return x + nudge, total + first

    run = jax.jit(lambda x: jax.lax.fori_loop(0, ITERATIONS, body, (x, jnp.float32(0))))
    jax.block_until_ready(run(features))
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        jax.block_until_ready(run(features))
        best = min(best, time.perf_counter() - start)
    return best / ITERATIONS * 1e6


def agree(model, features, k: int) -> bool:
    """The kernel's ids equal XLA's wherever XLA's k-th and (k+1)-th log-probs are clearly apart."""
    best, ids = draft_top_k(model, features, k, attn_impl="pallas")
    want_best, want_ids = draft_top_k(model, features, k + 1, attn_impl="xla")
    clear = np.asarray(want_best[..., k - 1] - want_best[..., k]) > 1e-2
    same = np.all(np.asarray(ids) == np.asarray(want_ids[..., :k]), axis=-1)
    close = np.allclose(np.asarray(best), np.asarray(want_best[..., :k]), atol=2e-2)
    return bool(np.all(same | ~clear) and close)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="49152x576,128256x4096", help="VOCABxHIDDEN, comma-separated")
    parser.add_argument("--rows", default="1,4,16,64")
    args = parser.parse_args(argv)
    rates = floors.measure_rates()
    print(
        f"{jax.devices()[0].device_kind}, jax {jax.__version__}; memory {rates.bandwidth / 1e9:.0f} GB/s; us per call"
    )
    print(
        "| V x H | rows | k | XLA us | kernel us | head floor us | XLA / kernel | kernel / floor | ids agree "
        "| int8 kernel us | int8 floor us | int8 / kernel | int8 / its floor | int8 ids as bf16's |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: |")
    for shape in args.shapes.split(","):
        vocab, hidden = (int(x) for x in shape.split("x"))
        head = jax.random.normal(jax.random.key(0), (vocab, hidden), jnp.bfloat16) * 0.05
        model = _HeadOnly(head)
        int8 = DraftHead(*quantized_rows(head), None)
        for rows in (int(r) for r in args.rows.split(",")):
            floor_us = rates.seconds(head.nbytes, 2 * rows * vocab * hidden) * 1e6  # the head read once
            int8_floor_us = rates.seconds(int8.rows.nbytes + int8.scale.nbytes, 2 * rows * vocab * hidden) * 1e6
            features = jax.random.normal(jax.random.key(rows), (1, rows, hidden), jnp.bfloat16)
            for k in (4, 16):
                xla_us = loop_us(functools.partial(draft_top_k, model, k=k, attn_impl="xla"), features)
                kernel_us = loop_us(functools.partial(draft_top_k, model, k=k, attn_impl="pallas"), features)
                int8_us = loop_us(lambda x, head=int8, k=k: head.top_k(x[0], k), features)
                same = np.mean(
                    np.asarray(int8.top_k(features[0], k)[1])
                    == np.asarray(draft_top_k(model, features, k, attn_impl="pallas")[1][0])
                )
                print(
                    f"| {vocab} x {hidden} | {rows} | {k} | {xla_us:.1f} | {kernel_us:.1f} | {floor_us:.1f} | "
                    f"{xla_us / kernel_us:.2f} | {kernel_us / floor_us:.2f} | {agree(model, features, k)} | "
                    f"{int8_us:.1f} | {int8_floor_us:.1f} | {int8_us / kernel_us:.2f} | {int8_us / int8_floor_us:.2f} "
                    f"| {100 * same:.0f} % |",
                    flush=True,
                )


class _HeadOnly:
    """What draft_top_k reads of a target model: its tied head (embed) and lm_logits."""

    lm_head = None

    def __init__(self, head):
        self.embed = head  # an array reads as itself through draft_top_k's `embed[...]`

    def lm_logits(self, hidden):
        return jnp.einsum("bth,vh->btv", hidden, self.embed, preferred_element_type=jnp.float32)


if __name__ == "__main__":
    main()
