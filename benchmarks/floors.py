"""What a decoding step must cost on this device, from rates measured in the same run.

A part's floor is the longer of its bytes at the memory rate and its matrix work at the matmul rate
(a roofline), summed over the parts that run one after the other:
- the products: every weight a step multiplies by, read once (the embedding table only where it is
  also the LM head: an untied table gives a step one row a token), against 2 FLOPs a weight a row;
- the attention over the cache: the K/V rows it reads against 4 Hq D FLOPs a query row and a key
  (scores and values), per layer.
All of a model's products have the same arithmetic intensity (rows a sequence against one weight),
so one roofline for them all is the sum of one per product. An AR step (one row) is bound by its
bytes everywhere; a verified tree of 64 rows is too in its products, but at a GQA model's long
context its attention is bound by the matrix work (Llama-3-8B: 256 query rows a KV head).
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp
from flax import nnx

from longspec_jax.decode_kit import cache_bytes
from longspec_jax.draft_head import reads_int8


@dataclasses.dataclass(frozen=True)
class Rates:
    bandwidth: float  # bytes a second: the better of a copy's (read + written) and a read-only sum's
    matmul: float  # bf16 FLOPs a second of a large square matmul

    def seconds(self, nbytes: float, flops: float) -> float:
        """The roofline: the longer of the bytes at the bandwidth and the FLOPs at the matmul rate."""
        return max(nbytes / self.bandwidth, flops / self.matmul)


def time_call(fn, input_sets, groups: int = 7) -> float:
    """Median seconds per call over `groups` groups of back-to-back calls (compile + warm-up first).

    Calls within a group are dispatched asynchronously, one jitted call each, cycling through the
    input sets, so host dispatch overlaps the GPU work of earlier calls. (Batching several calls
    into one jitted program was tried and rejected: XLA merged the calls that shared an input set,
    and timings came out up to 2x too fast.)
    """
    jax.block_until_ready(fn(*input_sets[0]))
    start = time.perf_counter()
    jax.block_until_ready(fn(*input_sets[1 % len(input_sets)]))
    estimate = time.perf_counter() - start
    calls = max(2, min(40, int(0.02 / max(estimate, 1e-6))))
    samples = []
    for g in range(groups):
        start = time.perf_counter()
        for i in range(calls):
            out = fn(*input_sets[(g * calls + i) % len(input_sets)])
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - start) / calls)
    return statistics.median(samples)


def measure_rates(small: bool = False) -> Rates:
    """This device's `Rates`: a 2 GiB copy and a read-only sum of it (the better counts: reads alone
    stream faster than a copy's mix), and an 8192-square bf16 matmul; small: 16 MiB and 512 (a
    smoke test on the CPU)."""
    elements, n = (1 << 23, 512) if small else (1 << 30, 8192)
    keys = jax.random.split(jax.random.key(0), 3)
    big = [(jax.random.normal(k, (elements,), jnp.bfloat16),) for k in keys[:2]]
    nbytes = big[0][0].nbytes
    copy_rate = 2 * nbytes / time_call(jax.jit(lambda x: x + 1), big)
    read_rate = nbytes / time_call(jax.jit(lambda x: jnp.sum(x, dtype=jnp.float32)), big)
    print(f"bandwidth: copy {copy_rate / 1e12:.2f} TB/s (read + write), read-only sum {read_rate / 1e12:.2f} TB/s")
    del big
    mats = [
        tuple(jax.random.normal(jax.random.fold_in(keys[2], 2 * i + j), (n, n), jnp.bfloat16) for j in range(2))
        for i in range(2)
    ]
    matmul = 2 * n**3 / time_call(jax.jit(jnp.matmul), mats)
    return Rates(bandwidth=max(copy_rate, read_rate), matmul=matmul)


def product_weights(model) -> int:
    """Weights a step multiplies by (`Transformer`): every parameter but an untied embedding table."""
    total = sum(x.size for x in jax.tree.leaves(nnx.state(model)))
    return total - (model.config.vocab_size * model.config.hidden_size if model.lm_head is not None else 0)


def step_seconds(model, rows: int, context: int, batch: int, rates: Rates) -> float:
    """The floor of one forward of `rows` new tokens a sequence (1: an AR step; a tree's nodes and
    its root: a verify) over `context` cached rows a sequence, through every layer and the LM head."""
    c = model.config
    itemsize = jnp.dtype(model.dtype).itemsize
    weights = product_weights(model)
    products = rates.seconds(weights * itemsize, 2 * batch * rows * weights)
    kv_rows = c.num_layers * batch * context
    attention = rates.seconds(
        2 * kv_rows * c.num_kv_heads * c.head_dim * itemsize, 4 * kv_rows * rows * c.num_heads * c.head_dim
    )
    return products + attention


def draft_level_seconds(model, draft, rows: int, context: int, batch: int, rates: Rates) -> float:
    """The floor of one level of a draft's tree: `rows` nodes a sequence through the draft's block,
    the shared LM head (the rows of its candidate tokens, if it has them; int8 and a float32 scale a
    row where the draft reads it so, draft_head.py; the block's matrices likewise, `block_bytes`)
    and its cross-attention to the target's
    last-layer K/V (`context` rows; the draft's own window left out)."""
    c = model.config
    itemsize = jnp.dtype(model.dtype).itemsize
    head_rows = c.vocab_size if draft.candidate_tokens is None else len(draft.candidate_tokens)
    int8 = reads_int8(draft.head_format, head_rows, c.hidden_size, model.dtype)
    block = jax.tree.leaves(nnx.state(draft.block))
    weights = sum(x.size for x in block) + head_rows * c.hidden_size
    head_bytes = head_rows * (c.hidden_size + 4) if int8 else head_rows * c.hidden_size * itemsize
    weight_bytes = block_bytes(draft) + head_bytes
    kv_rows = batch * context
    return rates.seconds(
        weight_bytes + 2 * kv_rows * c.num_kv_heads * c.head_dim * itemsize,
        2 * batch * rows * weights + 4 * kv_rows * rows * c.num_heads * c.head_dim,
    )


def block_bytes(draft) -> int:
    """Bytes a draft level reads of the draft's block: its parameters as they are held, or, where
    the draft holds its block as int8 (int8_rows.py), each matrix [in, out] at a byte an entry and
    a float32 scale an output."""
    block = jax.tree.leaves(nnx.state(draft.block))
    held = cache_bytes(block)
    if not draft.block_int8:
        return held
    matrices = [x for x in block if x.ndim == 2]
    return held - cache_bytes(matrices) + sum(m.size + 4 * m.shape[1] for m in matrices)


def draft_round_seconds(model, draft, widths, context: int, batch: int, rates: Rates) -> float:
    """The floor of a round's draft levels for a tree of `widths`: level i runs the nodes of depth i
    (the root alone first) and proposes the next depth's."""
    rows = (1, *widths[:-1])
    return sum(draft_level_seconds(model, draft, r, context, batch, rates) for r in rows)
