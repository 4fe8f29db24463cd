"""The draft's self-attention step, `attention.attend_and_write_slots`, against a float64
reference: RoPE, one attention over the slots and the block together, then the block's rows
written at their slots, after the slots were read (a commit overwrites ring slots its queries see).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from longspec_jax import attention
from longspec_jax.rope import rope_tables
from pallas_kernels.reference import attention_reference

TOL = dict(rtol=2e-5, atol=2e-5)


def random_step(rng, b, t, hq, hkv, s, d):
    """A block of t tokens and a buffer of s slots: qkv before RoPE, positions, the buffer, a mask
    with a row per sequence that sees nothing and one that sees only the block, and write slots
    that overwrite slots the queries see (as a commit overwrites the ring's oldest keys) or are
    dropped (s: a padding row)."""
    qkv = rng.standard_normal((b, t, hq + 2 * hkv, d), np.float32)
    positions = rng.integers(0, 5000, (b, t)).astype(np.int32)
    k_slots, v_slots = (rng.standard_normal((b, s, hkv, d), np.float32) for _ in range(2))
    slot_positions = rng.integers(-1, 5000, (b, s)).astype(np.int32)
    mask = rng.random((b, t, s + t)) < 0.5
    blind, only_block = rng.choice(t, 2, replace=False) if t > 1 else (0, 0)
    mask[:, only_block, :s] = False
    mask[:, only_block, s] = True
    mask[:, blind] = False
    write = np.stack([rng.choice(s, t, replace=False) for _ in range(b)]).astype(np.int32)
    write[:, rng.integers(0, t)] = s
    return qkv, positions, k_slots, v_slots, slot_positions, mask, write


def rotate64(x, positions, inv_freq):
    """RoPE in float64 (rope.rotate's layout) of x [B,T,H,D], by the float32 tables the model
    uses (what is checked is the kernel's rotation, not the tables' rounding at large angles)."""
    cos, sin = (np.asarray(t, np.float64) for t in rope_tables(jnp.asarray(positions), jnp.asarray(inv_freq)))
    x1, x2 = np.split(x.astype(np.float64), 2, axis=-1)
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def reference(qkv, positions, k_slots, v_slots, slot_positions, mask, write, hq, inv_freq):
    hkv = k_slots.shape[2]
    q = rotate64(qkv[:, :, :hq], positions, inv_freq)
    k = rotate64(qkv[:, :, hq : hq + hkv], positions, inv_freq)
    v = qkv[:, :, hq + hkv :].astype(np.float64)
    o, _ = attention_reference(q, np.concatenate([k_slots, k], 1), np.concatenate([v_slots, v], 1), mask)
    k_after, v_after, positions_after = k_slots.astype(np.float64), v_slots.astype(np.float64), slot_positions.copy()
    for row in range(qkv.shape[0]):
        for token, slot in enumerate(write[row]):
            if slot < k_slots.shape[1]:
                k_after[row, slot], v_after[row, slot] = k[row, token], v[row, token]
                positions_after[row, slot] = positions[row, token]
    return o, k_after, v_after, positions_after


def run(inputs, hq, inv_freq, dtype=jnp.float32):
    qkv, positions, k_slots, v_slots, slot_positions, mask, write = inputs
    b, t = qkv.shape[:2]
    as_dtype = lambda x: jnp.asarray(x, dtype)
    step = jax.jit(lambda *a: attention.attend_and_write_slots(a[0].reshape(b, t, -1), *a[1:], num_heads=hq))
    return step(
        as_dtype(qkv),
        jnp.asarray(inv_freq),
        as_dtype(k_slots),
        as_dtype(v_slots),
        jnp.asarray(slot_positions),
        jnp.asarray(mask),
        jnp.asarray(write),
        jnp.asarray(positions),
    )


def assert_matches(got, want, atol=TOL["atol"], rtol=TOL["rtol"]):
    o, k, v, positions = (np.asarray(x, np.float64) for x in got)
    want_o, want_k, want_v, want_positions = want
    assert np.isfinite(o).all(), "o has NaN/inf: an element was not written or a masked row blew up"
    np.testing.assert_allclose(o, want_o, rtol=rtol, atol=atol)
    np.testing.assert_allclose(k, want_k, rtol=rtol, atol=atol)
    np.testing.assert_allclose(v, want_v, rtol=rtol, atol=atol)
    np.testing.assert_array_equal(positions, want_positions)


# (B, T, Hq, Hkv, S, D): the SmolLM2 draft's commit and tree levels (9 query heads over 3, a 512-slot
# ring and 52 tree slots), MHA and a GQA group of 8 at D = 128, a slot count that is not a multiple
# of 64, one token.
CASES = [
    (1, 6, 9, 3, 564, 64),
    (2, 16, 9, 3, 564, 64),
    (2, 5, 4, 4, 70, 128),
    (1, 16, 32, 4, 200, 128),
    (3, 1, 8, 2, 33, 64),
]


@pytest.mark.parametrize("b,t,hq,hkv,s,d", CASES)
def test_attend_and_write_slots_matches_float64_reference(b, t, hq, hkv, s, d):
    rng = np.random.default_rng([b, t, hq, hkv, s, d])
    inputs = random_step(rng, b, t, hq, hkv, s, d)
    inv_freq = (1.0 / (10000.0 ** (np.arange(0, d, 2) / d))).astype(np.float32)
    got = run(inputs, hq, inv_freq)
    assert_matches(got, reference(*inputs, hq, inv_freq))
    blind = ~inputs[5].any(-1)
    assert blind.any() and (np.asarray(got[0])[blind] == 0).all()


def test_attend_and_write_slots_bfloat16():
    rng = np.random.default_rng(5)
    inputs = random_step(rng, 1, 16, 9, 3, 564, 64)
    inv_freq = (1.0 / (10000.0 ** (np.arange(0, 64, 2) / 64))).astype(np.float32)
    rounded = [np.asarray(jnp.asarray(x, jnp.bfloat16), np.float32) if x.dtype == np.float32 else x for x in inputs]
    got = run(inputs, 9, inv_freq, dtype=jnp.bfloat16)
    assert got[0].dtype == jnp.bfloat16 and got[1].dtype == jnp.bfloat16
    assert_matches(got, reference(*rounded, 9, inv_freq), atol=3e-2, rtol=3e-2)
