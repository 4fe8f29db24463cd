"""Products of 1-3 rows written as multiply-reduce (`PackedLinear.small_rows`, the GPU's inference
layout): the same values as the dot, against a float64 reference; only those row counts take that
path, and past one row only a weight small enough to re-read from the L2 cache; and a model in that
layout decodes exactly as the plain layout does (float32, greedy). A norm folded into the products
gives norm-then-product, whichever side its scale is applied on."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from longspec_jax.generation import generate
from longspec_jax.model import (
    SCALE_AFTER_MAX_WIDTH,
    SCALE_AFTER_ROWS,
    SMALL_ROWS,
    SMALL_ROWS_MAX_BYTES,
    Linear,
    PackedLinear,
    RMSNorm,
)
from longspec_jax.target import Target, random_target
from tests.tiny_models import tiny_config


def packed(d_in=24, outs=(16, 8), seed=0):
    rngs = nnx.Rngs(seed)
    parts = [Linear(d_in, d_out, bias=True, dtype=jnp.float32, rngs=rngs) for d_out in outs]
    for p in parts:  # non-zero biases, so their add is checked too
        p.bias[...] = jax.random.normal(jax.random.key(seed + 1), p.bias.shape)
    return parts, PackedLinear(parts, small_rows=SMALL_ROWS)


@pytest.mark.parametrize("shape", [(1, 1), (2, 1), (1, 2), (3, 1), (1, 3), (2, 2), (1, 5)])
def test_every_row_count_equals_a_float64_reference(shape):
    parts, linear = packed()
    x = np.random.default_rng(1).normal(size=(*shape, 24)).astype(np.float32)
    weight = np.concatenate([np.asarray(p.kernel[...], np.float64) for p in parts], axis=1)
    bias = np.concatenate([np.asarray(p.bias[...], np.float64) for p in parts])
    expected = x.astype(np.float64) @ weight + bias
    np.testing.assert_allclose(np.asarray(linear(jnp.asarray(x))), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("d_in", [24, SCALE_AFTER_MAX_WIDTH + 8])
@pytest.mark.parametrize("rows", [1, 3, 5, SCALE_AFTER_ROWS, 40])
def test_a_folded_norm_equals_norm_then_product_in_float64(rows, d_in):
    """Scaled before the product (few rows, or a wide input) or after it (many rows, a narrow one):
    both the float64 RMSNorm (random weight, eps) then the product."""
    rng = np.random.default_rng(rows + d_in)
    parts = [Linear(d_in, d_out, bias=True, dtype=jnp.float32, rngs=nnx.Rngs(rows)) for d_out in (16, 8)]
    norm = RMSNorm(d_in, 1e-5, dtype=jnp.float32)
    norm.weight[...] = jnp.asarray(rng.uniform(0.5, 1.5, d_in), jnp.float32)
    linear = PackedLinear(parts, SMALL_ROWS, norm)
    x = rng.normal(scale=3.0, size=(1, rows, d_in)).astype(np.float32)
    x64 = x.astype(np.float64)
    normed = x64 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + 1e-5) * np.asarray(norm.weight[...], np.float64)
    weight = np.concatenate([np.asarray(p.kernel[...], np.float64) for p in parts], axis=1)
    bias = np.concatenate([np.asarray(p.bias[...], np.float64) for p in parts])
    np.testing.assert_allclose(np.asarray(linear(jnp.asarray(x))), normed @ weight + bias, rtol=1e-4, atol=1e-4)
    # Which side: after the product (a dot here, never the small rows' reduction) a multiply follows.
    ops = [e.primitive.name for e in jax.make_jaxpr(linear)(jnp.asarray(x)).jaxpr.eqns]
    product = max(i for i, op in enumerate(ops) if op in ("dot_general", "reduce_sum"))
    scaled_after = "mul" in ops[product + 1 :]
    assert scaled_after == (rows >= SCALE_AFTER_ROWS and d_in <= SCALE_AFTER_MAX_WIDTH)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 8])
def test_only_small_row_counts_take_the_reduction(rows):
    _, linear = packed()
    jaxpr = str(jax.make_jaxpr(linear)(jnp.zeros((rows, 1, 24), jnp.float32)))
    reduced = rows in SMALL_ROWS
    assert ("reduce_sum" in jaxpr) == reduced and ("dot_general" in jaxpr) == (not reduced)


@pytest.mark.parametrize("rows", [1, 2, 3])
def test_past_one_row_a_large_weight_takes_the_dot(rows):
    """A weight over SMALL_ROWS_MAX_BYTES is reduced at one row only (the reduction reads it once a
    row); at most that size, at every small row count."""
    d_in = 1024
    for d_out, large in ((SMALL_ROWS_MAX_BYTES // (4 * d_in), False), (SMALL_ROWS_MAX_BYTES // (4 * d_in) + 1, True)):
        linear = PackedLinear([Linear(d_in, d_out, bias=False, dtype=jnp.float32, rngs=nnx.Rngs(0))], SMALL_ROWS)
        assert (linear.weight[...].nbytes > SMALL_ROWS_MAX_BYTES) == large
        jaxpr = str(jax.make_jaxpr(linear)(jnp.zeros((1, rows, d_in), jnp.float32)))
        reduced = rows == 1 or not large
        assert ("reduce_sum" in jaxpr) == reduced and ("dot_general" in jaxpr) == (not reduced), (rows, large)


def test_the_gpu_layout_decodes_as_the_plain_one():
    target = random_target(tiny_config(), seed=3, dtype="float32")
    gpu_layout = Target(target.config, target.model.inference_layout(SMALL_ROWS), target.tokenizer)
    assert gpu_layout.decode_model().layers[0].mlp.down_proj.small_rows == SMALL_ROWS  # kept, not repacked
    rng = np.random.default_rng(3)
    pair = [rng.integers(0, 128, 9).tolist(), rng.integers(0, 128, 13).tolist()]
    repetitive = [5, 6, 7, 8] * 6  # prompt lookup finds its chains here
    for prompts, mode, widths in ((pair, "ar", None), (repetitive, "pld", (1,)), (repetitive, "pld", (1, 1))):
        runs = [
            generate(t, prompts, mode=mode, tree_widths=widths, max_new_tokens=10, eos_token_ids=())
            for t in (target, gpu_layout)
        ]
        assert runs[0].tokens == runs[1].tokens, (mode, widths)
