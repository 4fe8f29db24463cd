"""The Pallas commit kernel (interpret mode) moves exactly the rows the XLA commit moves.

It only copies values, so every comparison is exact: against a NumPy loop over (sequence, step),
against model.commit's XLA path, and the rows it must not write keep their old values.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from longspec_jax.errors import UserError
from longspec_jax.model import BlockKV, KVCache, commit
from pallas_kernels.commit_rows import commit_rows


def random_arrays(rng, count, shape, dtype):
    return tuple(jnp.asarray(rng.normal(size=shape), dtype) for _ in range(count))


def expected_commit(caches, blocks, path, lengths):
    """Row path[b, i] of each block to row lengths[b] + i of its cache, one row at a time."""
    out = [np.array(c, np.float32) for c in caches]
    for o, blk in zip(out, blocks):
        blk = np.array(blk.astype(caches[0].dtype).astype(jnp.float32))
        for b in range(path.shape[0]):
            for i, row in enumerate(np.asarray(path[b])):
                o[b, int(lengths[b]) + i] = blk[b, row]
    return out


def as_f32(x):
    return np.array(x.astype(jnp.float32))


# (S, H, D, T, A): SmolLM2-like heads (H = 3, so A * H is no power of 2); a head dim that is not a
# power of 2 either (masked columns).
@pytest.mark.parametrize("s,h,d,t,a", [(40, 3, 64, 9, 5), (24, 2, 24, 6, 3)])
def test_kernel_writes_exactly_the_accepted_rows(s, h, d, t, a):
    rng = np.random.default_rng(0)
    layers, b = 3, 2
    caches = random_arrays(rng, 2 * layers, (b, s, h, d), jnp.bfloat16)
    blocks = random_arrays(rng, 2 * layers, (b, t, h, d), jnp.float32)
    # Sequence 0 skips nodes and repeats its last row; sequence 1 takes a different branch.
    path = jnp.asarray([[0, 2] + [t - 1] * (a - 2), list(range(a))[::-1]], jnp.int32)
    lengths = jnp.asarray([3, s - a - 1], jnp.int32)

    out = commit_rows(caches, blocks, path, lengths, interpret=True)

    want = expected_commit(caches, blocks, path, lengths)
    assert len(out) == 2 * layers
    for got, w, old in zip(out, want, caches):
        assert got.dtype == old.dtype and got.shape == old.shape
        np.testing.assert_array_equal(as_f32(got), w)
        for seq in range(b):
            untouched = np.ones(s, bool)
            untouched[int(lengths[seq]) : int(lengths[seq]) + a] = False
            np.testing.assert_array_equal(as_f32(got)[seq, untouched], as_f32(old)[seq, untouched])
            assert not np.array_equal(as_f32(got)[seq, ~untouched], as_f32(old)[seq, ~untouched])


def test_kernel_clamps_like_the_xla_ops():
    """A start past S - A and path entries outside [0, T): clamped as dynamic_update_slice and the
    XLA commit's clipping gather clamp them, so the two still agree."""
    rng = np.random.default_rng(1)
    b, s, h, d, t, a, layers = 2, 16, 3, 64, 5, 4, 2
    caches = random_arrays(rng, 2 * layers, (b, s, h, d), jnp.bfloat16)
    blocks = random_arrays(rng, 2 * layers, (b, t, h, d), jnp.bfloat16)
    path = jnp.asarray([[0, 7, -2, 4], [1, 1, 2, 9]], jnp.int32)
    lengths = jnp.asarray([s - 2, 5], jnp.int32)
    cache = KVCache(k=caches[:layers], v=caches[layers:], lengths=lengths)
    block = BlockKV(k=blocks[:layers], v=blocks[layers:])

    out = commit_rows(caches, blocks, path, lengths, interpret=True)

    ref = commit(cache, block, path, jnp.asarray([a, 2], jnp.int32), impl="xla")
    for got, want in zip(out, ref.k + ref.v):
        np.testing.assert_array_equal(as_f32(got), as_f32(want))


def test_model_commit_pallas_matches_xla():
    rng = np.random.default_rng(2)
    b, s, h, d, t, layers = 2, 32, 3, 64, 9, 3
    caches = random_arrays(rng, 2 * layers, (b, s, h, d), jnp.bfloat16)
    blocks = random_arrays(rng, 2 * layers, (b, t, h, d), jnp.float32)
    cache = KVCache(k=caches[:layers], v=caches[layers:], lengths=jnp.asarray([0, 11], jnp.int32))
    block = BlockKV(k=blocks[:layers], v=blocks[layers:])
    path = jnp.asarray([[0, 3, 3, 8], [0, 1, 5, 6]], jnp.int32)
    n_accept = jnp.asarray([3, 1], jnp.int32)

    got = commit(cache, block, path, n_accept, impl="pallas")
    want = commit(cache, block, path, n_accept, impl="xla")

    np.testing.assert_array_equal(np.asarray(got.lengths), [3, 12])
    np.testing.assert_array_equal(np.asarray(got.lengths), np.asarray(want.lengths))
    for g, w in zip(got.k + got.v, want.k + want.v):
        np.testing.assert_array_equal(as_f32(g), as_f32(w))


def expected_move(caches, path, lengths):
    """Row clip(lengths[b] + path[b, i], 0, S - 1) to row clip(lengths[b], 0, S - A) + i of each
    cache, every row read before any is written (the XLA gather, then the write)."""
    out = [np.array(c, np.float32) for c in caches]
    s, a = out[0].shape[1], path.shape[1]
    for o in out:
        for b in range(path.shape[0]):
            src = np.clip(int(lengths[b]) + np.asarray(path[b]), 0, s - 1)
            start = min(max(int(lengths[b]), 0), s - a)
            o[b, start : start + a] = o[b, src].copy()
    return out


# Sequence 0 walks a tree that skips nodes, its tail past n_accept back at node 0 (as acceptance
# leaves it); sequence 1 keeps every node but the first branch. Then a start past S - A (clamped)
# with a source row past the cache (clipped).
@pytest.mark.parametrize(
    "path,lengths", [([[0, 2, 5, 0, 0], [0, 1, 3, 4, 6]], [3, 11]), ([[0, 3, 1, 4, 2], [0, 2, 4, 6, 8]], [28, 0])]
)
def test_kernel_moves_rows_within_the_caches(path, lengths):
    """blocks=None: the verified rows already sit at [lengths, lengths + T) of each cache; the
    accepted ones move down to [lengths, lengths + A), in place, source rows read before they are
    overwritten (lane i reads row lengths + path[i], which lane path[i] writes)."""
    rng = np.random.default_rng(4)
    b, s, h, d, layers = 2, 32, 3, 64, 2
    caches = random_arrays(rng, 2 * layers, (b, s, h, d), jnp.bfloat16)
    path, lengths = jnp.asarray(path, jnp.int32), jnp.asarray(lengths, jnp.int32)
    a = path.shape[1]

    out = commit_rows(caches, None, path, lengths, interpret=True)

    want = expected_move(caches, path, lengths)
    for got, w, old in zip(out, want, caches):
        assert got.dtype == old.dtype and got.shape == old.shape
        np.testing.assert_array_equal(as_f32(got), w)
        for seq in range(b):
            start = min(int(lengths[seq]), s - a)
            untouched = np.ones(s, bool)
            untouched[start : start + a] = False
            np.testing.assert_array_equal(as_f32(got)[seq, untouched], as_f32(old)[seq, untouched])
            assert not np.array_equal(as_f32(got)[seq, ~untouched], as_f32(old)[seq, ~untouched])


def test_model_commit_takes_a_block_in_the_cache_through_the_kernel():
    """A BlockKV without arrays (the block in the cache at [lengths, lengths + T)) takes the kernel
    whatever impl says: the rows move within the cache and lengths grow by n_accept."""
    rng = np.random.default_rng(5)
    b, s, h, d, layers = 2, 24, 3, 64, 2
    caches = random_arrays(rng, 2 * layers, (b, s, h, d), jnp.bfloat16)
    cache = KVCache(k=caches[:layers], v=caches[layers:], lengths=jnp.asarray([2, 9], jnp.int32))
    path = jnp.asarray([[0, 1, 4], [0, 3, 0]], jnp.int32)
    n_accept = jnp.asarray([3, 2], jnp.int32)
    want = expected_move(caches, path, cache.lengths)
    for impl in ("pallas", "xla"):
        got = commit(cache, BlockKV(k=None, v=None), path, n_accept, impl=impl)
        np.testing.assert_array_equal(np.asarray(got.lengths), [5, 11])
        for g, w in zip(got.k + got.v, want):
            np.testing.assert_array_equal(as_f32(g), w)


def shapes(b=2, s=16, h=3, d=64, t=5, a=3, layers=2):
    caches = [jnp.zeros((b, s, h, d), jnp.bfloat16)] * (2 * layers)
    blocks = [jnp.zeros((b, t, h, d), jnp.bfloat16)] * (2 * layers)
    return caches, blocks, jnp.zeros((b, a), jnp.int32), jnp.zeros((b,), jnp.int32)


def bad_inputs():
    caches, blocks, path, lengths = shapes()
    odd_cache = jnp.zeros((2, 8, 3, 64), jnp.bfloat16)
    yield "no arrays", ([], [], path, lengths)
    yield "fewer blocks", (caches, blocks[:-1], path, lengths)
    yield "caches differ", (caches[:-1] + [odd_cache], blocks, path, lengths)
    yield "block heads", (caches, [jnp.zeros((2, 5, 2, 64), jnp.bfloat16)] * 4, path, lengths)
    yield "3-d cache", ([c[:, :, 0] for c in caches], blocks, path, lengths)
    yield "path batch", (caches, blocks, jnp.zeros((3, 3), jnp.int32), lengths)
    yield "path longer than cache", (caches, blocks, jnp.zeros((2, 17), jnp.int32), lengths)
    yield "lengths shape", (caches, blocks, path, jnp.zeros((2, 1), jnp.int32))
    yield "in cache: path longer than cache", (caches, None, jnp.zeros((2, 17), jnp.int32), lengths)
    yield "in cache: lengths shape", (caches, None, path, jnp.zeros((3,), jnp.int32))


@pytest.mark.parametrize("name,args", list(bad_inputs()), ids=[n for n, _ in bad_inputs()])
def test_bad_shapes_raise_value_error(name, args):
    with pytest.raises(ValueError, match="commit_rows"):
        commit_rows(*args, interpret=True)


def test_model_commit_reports_bad_shapes_as_user_error():
    caches, blocks, _, lengths = shapes()
    cache = KVCache(k=tuple(caches[:2]), v=tuple(caches[2:]), lengths=lengths)
    block = BlockKV(k=tuple(blocks[:2]), v=tuple(blocks[2:]))
    with pytest.raises(UserError, match="commit_rows: path"):
        commit(cache, block, jnp.zeros((2, 17), jnp.int32), lengths, impl="pallas")


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="the compiled Pallas kernel needs an NVIDIA GPU")
def test_gpu_compiled_kernel_matches_xla_commit():
    """The compiled kernel at SmolLM2's shapes (30 layers, 3 KV heads, bf16), inside a jit that
    donates the caches as the decode loop does, against the XLA commit."""
    rng = np.random.default_rng(3)
    b, s, h, d, t, a, layers = 2, 4096, 3, 64, 21, 6, 30
    caches = random_arrays(rng, 2 * layers, (b, s, h, d), jnp.bfloat16)
    blocks = random_arrays(rng, 2 * layers, (b, t, h, d), jnp.bfloat16)
    cache = KVCache(k=caches[:layers], v=caches[layers:], lengths=jnp.asarray([5, s - a], jnp.int32))
    block = BlockKV(k=blocks[:layers], v=blocks[layers:])
    path = jnp.asarray([[0, 4, 9, 9, 20, 3], [0, 1, 2, 3, 4, 5]], jnp.int32)
    n_accept = jnp.asarray([4, 6], jnp.int32)
    want = jax.jit(commit, static_argnames="impl")(cache, block, path, n_accept, impl="xla")
    want = [as_f32(x) for x in want.k + want.v]

    commit_in_place = jax.jit(commit, static_argnames="impl", donate_argnums=0)
    got = commit_in_place(cache, block, path, n_accept, impl="pallas")

    for g, w in zip(got.k + got.v, want):
        np.testing.assert_array_equal(as_f32(g), w)


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="the compiled Pallas kernel needs an NVIDIA GPU")
def test_gpu_compiled_in_cache_move_matches_numpy():
    """The compiled in-cache move at SmolLM2's shapes, caches donated: lanes read rows other lanes
    write, so only the barrier between the loads and the stores keeps the result exact."""
    rng = np.random.default_rng(6)
    b, s, h, d, layers = 2, 4096, 3, 64, 30
    caches = random_arrays(rng, 2 * layers, (b, s, h, d), jnp.bfloat16)
    path = jnp.asarray([[0, 1, 3, 5, 0, 0], [0, 2, 4, 6, 8, 10]], jnp.int32)
    lengths = jnp.asarray([7, 2000], jnp.int32)
    want = expected_move(caches, path, lengths)

    move_in_place = jax.jit(lambda c, p, n: commit_rows(c, None, p, n), donate_argnums=0)
    got = move_in_place(caches, path, lengths)

    for g, w in zip(got, want):
        np.testing.assert_array_equal(as_f32(g), w)
