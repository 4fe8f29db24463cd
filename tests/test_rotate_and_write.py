"""The rotation and cache-row writes of a block as one kernel (pallas_kernels.rotate_and_write), against
float64: q rotated out, the rotated k and the v at rows [lengths, lengths + T), every other row kept,
rows past the capacity dropped. In the Pallas interpreter on the CPU, compiled on a GPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import rotate_and_write as rw
from pallas_kernels.reference import rotated, with_rows_written


def _case(seed, b, t, hq, hkv, d, capacity, lengths):
    rng = np.random.default_rng(seed)
    qkv = rng.standard_normal((b, t, hq + 2 * hkv, d)).astype(jnp.bfloat16)
    k, v = (rng.standard_normal((b, capacity, hkv, d)).astype(jnp.bfloat16) for _ in range(2))
    angles = rng.uniform(0, 100, (b, t, d // 2))
    return qkv, np.cos(angles), np.sin(angles), k, v, np.asarray(lengths, np.int32)


def _reference(qkv, cos, sin, k, v, lengths, hq):
    """float64 q rotated, and the caches with the block's rows written (past the capacity: dropped)."""
    hkv = k.shape[2]
    qk = rotated(qkv[:, :, : hq + hkv], cos, sin)
    v_new = np.asarray(qkv[:, :, hq + hkv :], np.float64)
    return (
        qk[:, :, :hq],
        with_rows_written(k.astype(np.float64), qk[:, :, hq:], lengths),
        with_rows_written(v.astype(np.float64), v_new, lengths),
    )


def _run(case, hq, interpret):
    qkv, cos, sin, k, v, lengths = case
    return rw.rotate_and_write(
        jnp.asarray(qkv),
        jnp.asarray(cos, jnp.float32),
        jnp.asarray(sin, jnp.float32),
        jnp.asarray(k),
        jnp.asarray(v),
        jnp.asarray(lengths),
        num_heads=hq,
        interpret=interpret,
    )


def _check(got, want):
    (q, k, v), (q_want, k_want, v_want) = got, want
    assert q.shape == q_want.shape and q.dtype == jnp.bfloat16
    # The rotation runs in float32 and is rounded to bf16 once; the values are copied.
    np.testing.assert_allclose(np.asarray(q, np.float64), q_want, atol=2e-2, rtol=1e-2)
    np.testing.assert_allclose(np.asarray(k, np.float64), k_want, atol=2e-2, rtol=1e-2)
    np.testing.assert_array_equal(np.asarray(v, np.float64), v_want)


@pytest.mark.parametrize(
    "b, t, hq, hkv, d, capacity, lengths",
    [
        (2, 64, 8, 2, 64, 256, [0, 150]),  # a verify's 64 tokens, two sequences at different rows
        (1, 5, 4, 4, 32, 40, [38]),  # tokens off the program's 16, three of them past the capacity
        (3, 1, 6, 2, 16, 8, [7, 0, 3]),  # one token (an AR step), the last row
    ],
)
def test_matches_float64_in_the_interpreter(b, t, hq, hkv, d, capacity, lengths):
    case = _case(0, b, t, hq, hkv, d, capacity, lengths)
    _check(_run(case, hq, interpret=True), _reference(*case, hq))


def test_rejects_a_product_of_other_heads():
    case = _case(1, 1, 4, 4, 2, 32, 16, [0])
    with pytest.raises(ValueError, match=r"must hold 6 \+ 2 x 2 heads"):
        _run(case, 6, interpret=True)


def test_rejects_a_head_dim_off_the_powers_of_two():
    qkv = jnp.zeros((1, 4, 3, 48), jnp.bfloat16)
    cache = jnp.zeros((1, 16, 1, 48), jnp.bfloat16)
    cos = jnp.zeros((1, 4, 24), jnp.float32)
    with pytest.raises(ValueError, match="D a power of two"):
        rw.rotate_and_write(qkv, cos, cos, cache, cache, jnp.zeros((1,), jnp.int32), num_heads=1)


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="the compiled Triton kernel needs an NVIDIA GPU")
def test_compiled_matches_float64():
    case = _case(2, 2, 64, 32, 8, 128, 4096, [0, 4000])
    _check(_run(case, 32, interpret=False), _reference(*case, 32))
