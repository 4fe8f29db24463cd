"""head_top_k (interpret mode) == the top k of a float64 log-softmax over hidden @ head.T.

The reference sorts stably, so equal log-probs come out lowest token id first, as jax.lax.top_k
orders them. Shapes put V off the tile size (a last tile partly past V), R off the row block, and
H at SmolLM2's 576 (nine chunks of 64) as well as at a width that is no power of two.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.head_top_k import LOW_STEPS, head_top_k, int8_parts


def reference(hidden, head, k, noise=None):
    """(log_probs, ids) [R, k] from float64 logits of the inputs as given (already rounded). With
    noise [G, V]: (log-prob + noise, ids), each row ranked with its group's noise row added."""
    logits = np.asarray(hidden, np.float64) @ np.asarray(head, np.float64).T
    top = logits.max(axis=1, keepdims=True)
    scores = logits - top - np.log(np.exp(logits - top).sum(axis=1, keepdims=True))
    if noise is not None:
        scores = scores + np.repeat(np.asarray(noise, np.float64), hidden.shape[0] // noise.shape[0], axis=0)
    ids = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    return np.take_along_axis(scores, ids, axis=1), ids


def random_inputs(rng, r, v, h, dtype):
    """Logits of a few units, as an LM head gives; rounded to dtype before the reference sees them."""
    hidden = jnp.asarray(rng.standard_normal((r, h)), dtype)
    head = jnp.asarray(rng.standard_normal((v, h)) * (3.0 / np.sqrt(h)), dtype)
    return hidden, head


def as_f64(x):
    return np.asarray(x.astype(jnp.float32), np.float64)


# (R, V, H, k, block sizes): one row, rows in one block, rows over several blocks (37 rows in blocks
# of 16, the last partly past R); V = 1000 and 4099 end in a partial tile.
CASES = [
    (1, 1000, 64, 4, {}),
    (3, 4099, 96, 16, {}),
    (16, 1000, 576, 1, {}),
    (37, 4099, 64, 16, {"block_rows": 16, "block_vocab": 128}),
    (37, 1000, 96, 5, {"block_vocab": 512}),
    (3, 1000, 576, 4, {"block_h": 64}),
]


@pytest.mark.parametrize("r,v,h,k,blocks", CASES)
def test_float32_matches_float64_reference(r, v, h, k, blocks):
    hidden, head = random_inputs(np.random.default_rng([r, v, h, k]), r, v, h, jnp.float32)

    log_probs, ids = head_top_k(hidden, head, k, interpret=True, **blocks)

    want_log_probs, want_ids = reference(as_f64(hidden), as_f64(head), k)
    assert log_probs.shape == ids.shape == (r, k)
    assert log_probs.dtype == jnp.float32 and ids.dtype == jnp.int32
    np.testing.assert_allclose(np.asarray(log_probs), want_log_probs, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(ids), want_ids)


# (G, rows per group, V, H, k, block sizes): one group; two groups of 3 rows; 3 groups of 20 rows in
# blocks of 16 (a group's last block partly past it); V off the tile.
NOISE_CASES = [
    (1, 4, 1000, 64, 4, {}),
    (2, 3, 4099, 96, 2, {}),
    (3, 20, 1000, 64, 5, {"block_rows": 16, "block_vocab": 128}),
]


@pytest.mark.parametrize("g,w,v,h,k,blocks", NOISE_CASES)
def test_noise_ranks_each_group_against_float64_reference(g, w, v, h, k, blocks):
    """With Gumbel noise per group, the kernel's picks and values are the reference's: the noise
    moves which tokens win (the test fails if a row reads another group's noise or none)."""
    rng = np.random.default_rng([g, w, v, k])
    hidden, head = random_inputs(rng, g * w, v, h, jnp.float32)
    noise = jnp.asarray(rng.gumbel(size=(g, v)), jnp.float32)

    values, ids = head_top_k(hidden, head, k, noise=noise, interpret=True, **blocks)

    want_values, want_ids = reference(as_f64(hidden), as_f64(head), k, np.asarray(noise))
    np.testing.assert_array_equal(np.asarray(ids), want_ids)
    np.testing.assert_allclose(np.asarray(values), want_values, rtol=1e-5, atol=1e-5)
    _, plain_ids = reference(as_f64(hidden), as_f64(head), k)
    assert (want_ids != plain_ids).any()  # the noise changed the picks: the test can tell
    if g > 1:
        shuffled = reference(as_f64(hidden), as_f64(head), k, np.asarray(noise)[::-1])[1]
        assert (want_ids != shuffled).any()


def test_zero_noise_gives_the_log_probs():
    hidden, head = random_inputs(np.random.default_rng(3), 6, 1000, 64, jnp.float32)

    values, ids = head_top_k(hidden, head, 4, noise=jnp.zeros((2, 1000)), interpret=True)

    want_values, want_ids = head_top_k(hidden, head, 4, interpret=True)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(want_ids))
    np.testing.assert_array_equal(np.asarray(values), np.asarray(want_values))


@pytest.mark.parametrize("r,v,h,k,blocks", [(3, 1000, 576, 16, {}), (37, 4099, 96, 4, {"block_rows": 16})])
def test_bfloat16_matches_float64_reference_of_the_rounded_inputs(r, v, h, k, blocks):
    """bf16 products are exact in float32, so only the float32 sums differ from the reference: ids
    must agree wherever the reference's neighbouring log-probs are further apart than that."""
    tol = 1e-3
    hidden, head = random_inputs(np.random.default_rng([r, v, h, k, 1]), r, v, h, jnp.bfloat16)

    log_probs, ids = head_top_k(hidden, head, k, interpret=True, **blocks)

    want_log_probs, want_ids = reference(as_f64(hidden), as_f64(head), k + 1)
    np.testing.assert_allclose(np.asarray(log_probs), want_log_probs[:, :k], rtol=0, atol=tol)
    gaps = -np.diff(want_log_probs, axis=1)  # gaps[:, j] between places j and j + 1
    before = np.concatenate([np.full((r, 1), np.inf), gaps[:, :-1]], axis=1)
    settled = (before > tol) & (gaps > tol)
    assert settled.mean() > 0.9
    np.testing.assert_array_equal(np.asarray(ids)[settled], want_ids[:, :k][settled])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_ties_go_to_the_lower_token_id(dtype):
    """Small integer inputs give exact logits; the head repeats four distinct rows, so every logit
    is shared by a quarter of the vocabulary, across tiles and within them."""
    rng = np.random.default_rng(7)
    r, v, h, k = 5, 700, 32, 16
    distinct = rng.integers(-2, 3, size=(4, h))
    head = jnp.asarray(distinct[rng.integers(0, 4, size=v)], dtype)
    hidden = jnp.asarray(rng.integers(-2, 3, size=(r, h)), dtype)

    log_probs, ids = head_top_k(hidden, head, k, interpret=True, block_vocab=128)

    want_log_probs, want_ids = reference(as_f64(hidden), as_f64(head), k)
    np.testing.assert_array_equal(np.asarray(ids), want_ids)
    np.testing.assert_allclose(np.asarray(log_probs), want_log_probs, rtol=1e-5, atol=1e-5)
    lax_ids = jax.lax.top_k(jnp.asarray(hidden, jnp.float32) @ jnp.asarray(head, jnp.float32).T, k)[1]
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(lax_ids))


@pytest.mark.parametrize("v,k", [(20, 16), (20, 20), (1, 1)])
def test_vocabulary_smaller_than_one_tile(v, k):
    """One tile, mostly past V: the masked tokens never win, even when k takes every real one."""
    hidden, head = random_inputs(np.random.default_rng(v + k), 3, v, 64, jnp.float32)

    log_probs, ids = head_top_k(hidden, head, k, interpret=True)

    want_log_probs, want_ids = reference(as_f64(hidden), as_f64(head), k)
    np.testing.assert_array_equal(np.asarray(ids), want_ids)
    np.testing.assert_allclose(np.asarray(log_probs), want_log_probs, rtol=1e-5, atol=1e-5)


def int8_rows(rng, v, h):
    """An int8 head of v rows and its float32 scale a row, as draft_head quantises one (|q| <= 127)."""
    head = jnp.asarray(rng.integers(-127, 128, size=(v, h)), jnp.int8)
    scale = jnp.asarray(rng.uniform(0.5, 2.0, size=v) * (3.0 / (127 * np.sqrt(h))), jnp.float32)
    return head, scale


# (R, V, H, k, hidden dtype, noise groups, block sizes): V off the tile, rows over several blocks,
# a bf16 hidden state (the GPU's), and Gumbel noise a group.
INT8_CASES = [
    (3, 1000, 64, 4, jnp.float32, 0, {}),
    (37, 4099, 96, 16, jnp.float32, 0, {"block_rows": 16, "block_vocab": 128}),
    (16, 1000, 576, 8, jnp.bfloat16, 0, {}),
    (6, 1000, 64, 4, jnp.float32, 2, {}),
    (64, 1000, 64, 16, jnp.bfloat16, 4, {}),  # a batch of 4's tree level: four groups in one block
    (16, 1000, 576, 8, jnp.bfloat16, 0, {"block_h": 32}),
]


def as_parts_represent(hidden):
    """hidden as `int8_parts` hands it to an int8 head's tiles, in float64."""
    high, low, scale = (np.asarray(a, np.float64) for a in int8_parts(hidden))
    return scale[:, None] * (high + low / LOW_STEPS)


@pytest.mark.parametrize("r,v,h,k,dtype,groups,blocks", INT8_CASES)
def test_int8_head_matches_float64_reference_of_the_scaled_rows(r, v, h, k, dtype, groups, blocks):
    """An int8 head with a scale a row ranks as the float64 head head[v] * scale[v] does against
    the hidden state as its two int8 parts hold it: the int8 products are exact and the scales
    multiply each float32 logit. The test fails if a scale or the low part is dropped, a scale
    is applied to the wrong tokens, or the rows are read as another dtype."""
    rng = np.random.default_rng([r, v, h, k, groups])
    hidden = jnp.asarray(rng.standard_normal((r, h)), dtype)
    head, scale = int8_rows(rng, v, h)
    noise = jnp.asarray(rng.gumbel(size=(groups, v)), jnp.float32) if groups else None

    values, ids = head_top_k(hidden, head, k, head_scale=scale, noise=noise, interpret=True, **blocks)

    scaled = np.asarray(head, np.float64) * np.asarray(scale, np.float64)[:, None]
    represented = as_parts_represent(hidden)
    want_values, want_ids = reference(represented, scaled, k, None if noise is None else np.asarray(noise))
    np.testing.assert_allclose(np.asarray(values), want_values, rtol=1e-5, atol=2e-5)
    np.testing.assert_array_equal(np.asarray(ids), want_ids)
    _, unscaled_ids = reference(represented, np.asarray(head, np.float64), k)
    assert (unscaled_ids != want_ids).any()  # the scale changes the ranking: the test can tell
    exact_values, _ = reference(as_f64(hidden), scaled, k, None if noise is None else np.asarray(noise))
    np.testing.assert_allclose(want_values, exact_values, atol=1e-3)  # the parts' rounding is small


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_int8_parts_hold_each_row_to_its_bound(dtype):
    """scale * (high + low / LOW_STEPS) is within scale / (2 * LOW_STEPS) of every entry (a row of
    one outlier, a row of zeros, ordinary rows); the high part alone is not."""
    rng = np.random.default_rng(0)
    rows = rng.standard_normal((5, 4096)) * np.array([[1.0], [30.0], [1e-3], [0.0], [1.0]])
    rows[4, 7] = 500.0  # a massive activation
    hidden = jnp.asarray(rows, dtype)
    high, low, scale = int8_parts(hidden)

    assert high.dtype == low.dtype == jnp.int8 and scale.dtype == jnp.float32
    x = as_f64(hidden)
    # the bound, and float32's rounding of x / scale (up to 127 units at 2^-23): under 1 % of it
    bound = np.asarray(scale, np.float64)[:, None] / (2 * LOW_STEPS) * 1.01
    assert np.all(np.abs(as_parts_represent(hidden) - x) <= bound)
    np.testing.assert_array_equal(np.asarray(scale)[3], 1.0)
    np.testing.assert_array_equal(np.asarray(high)[3], 0)
    high_alone = np.asarray(scale, np.float64)[:, None] * np.asarray(high, np.float64)
    assert np.any(np.abs(high_alone - x) > bound)


def bad_inputs():
    hidden, head = jnp.zeros((2, 64), jnp.bfloat16), jnp.zeros((100, 64), jnp.bfloat16)
    yield "k = 0", (hidden, head, 0), {}, "k must be"
    yield "k > V", (hidden, head, 101), {}, "k must be"
    yield "H differs", (hidden, jnp.zeros((100, 32), jnp.bfloat16), 4), {}, "must share H"
    yield "dtypes differ", (hidden, head.astype(jnp.float32), 4), {}, "float dtype"
    yield "integer inputs", (hidden.astype(jnp.int32), head.astype(jnp.int32), 4), {}, "floating point"
    yield "1-d hidden", (hidden[0], head, 4), {}, r"hidden \[R, H\]"
    yield "no rows", (hidden[:0], head, 4), {}, "at least one row"
    yield "H not a multiple of 16", (hidden[:, :40], head[:, :40], 4), {}, "multiple of 16"
    yield "block_vocab", (hidden, head, 4), {"block_vocab": 96}, "block_vocab must be a power of two"
    yield "block_rows", (hidden, head, 4), {"block_rows": 8}, "block_rows must be a power of two"
    yield "block_h", (hidden, head, 4), {"block_h": 24}, "block_h must be a power of two"
    yield "block_h past H", (hidden, head, 4), {"block_h": 128}, "block_h 128 must divide H = 64"
    yield "noise of another V", (hidden, head, 4), {"noise": jnp.zeros((1, 99))}, r"noise must be \[G, V=100\]"
    yield "noise groups", (hidden, head, 4), {"noise": jnp.zeros((3, 100))}, "G dividing the 2 rows"
    int8 = head.astype(jnp.int8)
    yield "int8 head, no scale", (hidden, int8, 4), {}, "float dtype"
    yield "scale, float head", (hidden, head, 4), {"head_scale": jnp.ones((100,))}, "goes with an int8 head"
    yield "scale of another V", (hidden, int8, 4), {"head_scale": jnp.ones((99,))}, "goes with an int8 head"
    yield "int8 chunk", (hidden, int8, 4), {"head_scale": jnp.ones((100,)), "block_h": 16}, "at least 32"
    odd = jnp.zeros((2, 48), jnp.bfloat16), jnp.zeros((100, 48), jnp.int8)
    yield "int8 head, H = 48", (*odd, 4), {"head_scale": jnp.ones((100,))}, "H must be a multiple of 32"


@pytest.mark.parametrize("name,args,kwargs,match", list(bad_inputs()), ids=[c[0] for c in bad_inputs()])
def test_bad_inputs_raise_value_error(name, args, kwargs, match):
    with pytest.raises(ValueError, match=f"head_top_k: .*{match}"):
        head_top_k(*args, interpret=True, **kwargs)


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="the compiled Pallas kernel needs an NVIDIA GPU")
@pytest.mark.parametrize("r,k", [(1, 16), (64, 4)])
def test_gpu_compiled_kernel_matches_xla(r, k):
    """The compiled kernels at SmolLM2's head (49,152 x 576, bf16) against XLA's log-softmax and top-k."""
    hidden, head = random_inputs(np.random.default_rng(r), r, 49152, 576, jnp.bfloat16)

    log_probs, ids = jax.jit(lambda x, w: head_top_k(x, w, k))(hidden, head)

    logits = jnp.dot(hidden, head.T, preferred_element_type=jnp.float32)
    want_log_probs, want_ids = jax.lax.top_k(jax.nn.log_softmax(logits), k)
    np.testing.assert_allclose(np.asarray(log_probs), np.asarray(want_log_probs), atol=1e-3)
    gaps = -np.diff(np.asarray(jax.lax.top_k(jax.nn.log_softmax(logits), k + 1)[0]), axis=1)
    settled = gaps > 1e-3
    settled[:, 1:] &= gaps[:, :-1] > 1e-3
    np.testing.assert_array_equal(np.asarray(ids)[settled], np.asarray(want_ids)[settled])


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="the compiled Pallas kernel needs an NVIDIA GPU")
@pytest.mark.parametrize("r,k,groups", [(1, 16, 0), (16, 4, 0), (64, 16, 4)])
def test_gpu_compiled_kernel_over_an_int8_head_matches_xla(r, k, groups):
    """The compiled kernels over a 7B's int8 head (32,000 x 4,096 and a scale a row) against XLA's
    log-softmax and top-k of the same scaled rows; with groups, a batch's tree level: each group's
    rows ranked under its own noise row, all in one block."""
    rng = np.random.default_rng(r)
    hidden = jnp.asarray(rng.standard_normal((r, 4096)), jnp.bfloat16)
    head, scale = int8_rows(rng, 32000, 4096)
    noise = jnp.asarray(rng.gumbel(size=(groups, 32000)), jnp.float32) if groups else None

    log_probs, ids = jax.jit(lambda x, w, s, n: head_top_k(x, w, k, head_scale=s, noise=n))(hidden, head, scale, noise)

    logits = jnp.dot(hidden, head.astype(jnp.bfloat16).T, preferred_element_type=jnp.float32) * scale
    raced = jax.nn.log_softmax(logits) + (0.0 if noise is None else jnp.repeat(noise, r // groups, axis=0))
    want = jax.lax.top_k(raced, k + 1)
    np.testing.assert_allclose(np.asarray(log_probs), np.asarray(want[0][:, :k]), atol=1e-3)
    gaps = -np.diff(np.asarray(want[0]), axis=1)
    settled = gaps > 1e-3
    settled[:, 1:] &= gaps[:, :-1] > 1e-3
    np.testing.assert_array_equal(np.asarray(ids)[settled], np.asarray(want[1][:, :k])[settled])
