"""The verify's cache half on the Mosaic GPU kernel (attention.cache_on_hopper_units): when the route
is taken, and that the route rotates, writes and attends as the fused Triton kernel does, against
float64 (the Mosaic GPU kernel in the GPU interpreter on the CPU, compiled on a Hopper GPU)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from longspec_jax import attention
from pallas_kernels import cache_attention_mgpu as mgpu_cache
from pallas_kernels import flash_block
from pallas_kernels.reference import (
    attention_reference,
    block_visibility,
    random_tree_mask,
    rotated,
    with_rows_written,
)

T = mgpu_cache.QUERY_ROWS


@pytest.mark.parametrize(
    "batch, tokens, hq, hkv, d, rows, dtype, on_hopper, taken",
    [
        (1, 64, 32, 8, 128, 32896, jnp.bfloat16, True, True),  # Llama-3-8B: head pairs
        (8, 64, 32, 8, 128, 32896, jnp.bfloat16, True, True),  # pairs at any batch
        (1, 64, 28, 4, 128, 4096, jnp.bfloat16, True, True),  # Qwen2.5-7B's group of 7: one head a block
        (1, 64, 32, 32, 128, 4096, jnp.bfloat16, True, True),  # MHA (Vicuna-7B)
        (4, 64, 32, 32, 128, 4096, jnp.bfloat16, True, True),  # 128 one-head blocks: one wave
        (4, 64, 40, 8, 128, 4096, jnp.bfloat16, True, False),  # QwQ-32B at batch 4: 160 blocks
        (1, 64, 32, 8, 128, 32896, jnp.bfloat16, False, False),  # not a Hopper GPU
        (1, 63, 32, 8, 128, 4096, jnp.bfloat16, True, False),  # a tree of another size
        (1, 64, 32, 8, 128, 4096, jnp.float32, True, False),  # a float32 cache
        (1, 64, 32, 8, 128, 4160, jnp.bfloat16, True, False),  # rows off the 128-row tiles
        (1, 64, 16, 8, 192, 4096, jnp.bfloat16, True, False),  # a head dim off the powers of two
        (1, 64, 8, 2, 64, 8192, jnp.float16, True, True),
        (1, 64, 9, 3, 64, 8192, jnp.bfloat16, True, False),  # SmolLM2: one head a block at head dim 64
    ],
)
def test_route_taken_only_where_the_kernel_applies(batch, tokens, hq, hkv, d, rows, dtype, on_hopper, taken):
    k_cache = jax.ShapeDtypeStruct((batch, rows, hkv, d), dtype)
    assert attention.cache_on_hopper_units(tokens, hq, k_cache, on_hopper=on_hopper) is taken


def _verify(seed, lengths, capacity, hq=8, hkv=2, d=64):
    """attend_and_write_block on a 64-token verify in bf16, and its float64 reference: o, k, v."""
    rng = np.random.default_rng(seed)
    b = len(lengths)
    qkv = rng.standard_normal((b, T, hq + 2 * hkv, d), np.float32).astype(jnp.bfloat16).astype(np.float32)
    k, v = (rng.standard_normal((b, capacity, hkv, d)).astype(jnp.bfloat16).astype(np.float32) for _ in range(2))
    lengths = np.asarray(lengths, np.int32)
    mask = np.asarray(random_tree_mask(rng, b, T))
    angles = rng.uniform(0, 100, (b, T, 1, d // 2))
    cos, sin = np.cos(angles), np.sin(angles)
    o, k_out, v_out = attention.attend_and_write_block(
        jnp.asarray(qkv.reshape(b, T, -1), jnp.bfloat16),
        (jnp.asarray(cos, jnp.float32), jnp.asarray(sin, jnp.float32)),
        jnp.asarray(k, jnp.bfloat16),
        jnp.asarray(v, jnp.bfloat16),
        jnp.asarray(lengths),
        jnp.asarray(mask),
        num_heads=hq,
        impl="pallas",
    )
    qk = rotated(qkv[:, :, : hq + hkv], cos[:, :, 0], sin[:, :, 0])
    k_want = with_rows_written(k.astype(np.float64), qk[:, :, hq:], lengths)
    v_want = with_rows_written(v.astype(np.float64), qkv[:, :, hq + hkv :].astype(np.float64), lengths)
    ref, _ = attention_reference(qk[:, :, :hq], k_want, v_want, block_visibility(lengths, mask, capacity))
    return (o, k_out, v_out), (ref, k_want, v_want)


def _check(got, want):
    (o, k_out, v_out), (ref, k_want, v_want) = got, want
    assert o.shape == ref.shape and o.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(o, np.float64), ref, atol=2e-2)
    # The rotated keys are rounded to bf16 once; the values are copied.
    np.testing.assert_allclose(np.asarray(k_out, np.float64), k_want, atol=2e-2)
    np.testing.assert_array_equal(np.asarray(v_out, np.float64), v_want)


@pytest.mark.parametrize("hq, hkv, d", [(8, 2, 64), (6, 2, 128)])  # head pairs (group 4), one head a block (3)
def test_route_matches_float64_in_the_interpreter(monkeypatch, hq, hkv, d):
    """A sequence in the first tile and one over four 64-row tiles; the route is forced, its kernel
    run by the interpreter."""
    calls = []
    compiled = mgpu_cache.cache_attention

    def interpreted(*args, **kwargs):
        calls.append(kwargs["block_mask"] is not None)
        return compiled(*args, interpret=plgpu.InterpretGPUParams(), num_splits=2, **kwargs)

    monkeypatch.setattr(attention, "on_hopper", lambda: True)
    monkeypatch.setattr(mgpu_cache, "cache_attention", interpreted)
    monkeypatch.setattr(flash_block, "default_interpret", lambda: True)  # the Triton kernels too
    with jax.default_device(jax.devices("cpu")[0]):  # the interpreter runs on the CPU, GPU or not
        got, want = _verify(0, [37, 250], capacity=384, hq=hq, hkv=hkv, d=d)
    assert calls == [True]  # the route ran, the block's own keys inside the kernel
    _check(got, want)


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="the compiled Mosaic GPU kernel needs a Hopper GPU")
@pytest.mark.parametrize("hq, hkv", [(32, 8), (32, 32), (40, 8)])  # head pairs, MHA, a group of 5
def test_route_matches_float64_compiled(hq, hkv):
    if not attention.on_hopper():
        pytest.skip("not a Hopper GPU")
    got, want = _verify(1, [0, 3001, 8000], capacity=8192, hq=hq, hkv=hkv, d=128)
    _check(got, want)
