"""Tree verification under impl "pallas" writes the block's K/V past the cache end in the attention
kernel and commit moves the accepted rows within the cache (kernels in interpret mode): the logits
and the committed cache equal impl "xla"'s, which keeps the block's K/V as arrays."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from longspec_jax import model as model_module
from longspec_jax.draft import DraftConfig
from longspec_jax.draft_io import init_draft
from longspec_jax.generation import generate
from longspec_jax.model import commit, init_cache
from longspec_jax.target import Target, random_target
from pallas_kernels.reference import random_tree_mask
from tests.tiny_models import tiny_config

MAX_LEN = 24


@functools.partial(jax.jit, static_argnums=0)
def _prefill(graphdef, params, tokens, lengths, cache):
    return nnx.merge(graphdef, params).prefill(tokens, lengths, cache, attn_impl="xla")


@functools.partial(jax.jit, static_argnums=(0, 7))
def _verify_and_commit(graphdef, params, tokens, positions, mask, cache, path_and_accept, impl):
    logits, verified, block = nnx.merge(graphdef, params).forward_block(tokens, positions, mask, cache, attn_impl=impl)
    return logits, verified, block, commit(verified, block, *path_and_accept, impl=impl)


def tree_path(mask, node, depth):
    """The root-to-node walk through a tree mask (ancestors in index order), padded with node 0
    to depth + 1 entries as acceptance leaves it."""
    walk = np.flatnonzero(mask[node])
    return np.pad(walk, (0, depth + 1 - len(walk)))


@pytest.mark.parametrize("fused_projections", [False, True])
def test_pallas_verify_and_commit_match_xla(fused_projections):
    # Head dim 64 (the smallest the kernels take), two query heads per KV head.
    config = tiny_config(head_dim=64, num_heads=4, num_kv_heads=2, num_layers=2)
    model = random_target(config, seed=6, dtype="float32").model.inference_layout()
    model.fused_projections = fused_projections  # the projections as fused_linear kernels or XLA's
    graphdef, params = nnx.split(model)
    rng = np.random.default_rng(6)
    lengths = np.asarray([11, 4], np.int32)
    prompts = rng.integers(0, config.vocab_size, size=(2, 12)).astype(np.int32)
    _, cache = _prefill(graphdef, params, prompts, lengths, init_cache(config, 2, MAX_LEN, jnp.float32))

    t = 7
    mask = random_tree_mask(rng, 2, t)
    depth = mask.sum(-1) - 1
    tokens = rng.integers(0, config.vocab_size, size=(2, t)).astype(np.int32)
    positions = (lengths[:, None] + depth).astype(np.int32)
    deepest = int(depth.max())
    # Sequence 0 keeps the walk to its last node (it skips nodes); sequence 1 only its root.
    path = np.stack([tree_path(mask[0], t - 1, deepest), tree_path(mask[1], 0, deepest)])
    n_accept = np.asarray([depth[0, t - 1] + 1, 1], np.int32)
    args = (graphdef, params, tokens, positions, mask, cache, (jnp.asarray(path), jnp.asarray(n_accept)))

    logits, verified, block, committed = _verify_and_commit(*args, "pallas")
    logits_x, verified_x, block_x, committed_x = _verify_and_commit(*args, "xla")

    assert block.in_cache and not block_x.in_cache
    np.testing.assert_allclose(np.asarray(logits), np.asarray(logits_x), rtol=1e-5, atol=1e-6)
    for seq, n in enumerate(lengths):
        for got, old, new in zip(verified.k + verified.v, cache.k + cache.v, block_x.k + block_x.v):
            # The prefix is left alone; the block's rotated K/V sit right after it (from the fused
            # projection kernels: float32 sums in another order than XLA's, hence not bit-equal).
            np.testing.assert_array_equal(np.asarray(got[seq, :n]), np.asarray(old[seq, :n]))
            np.testing.assert_allclose(np.asarray(got[seq, n : n + t]), np.asarray(new[seq]), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(committed.lengths), lengths + n_accept)
    np.testing.assert_array_equal(np.asarray(committed_x.lengths), lengths + n_accept)
    for seq, n in enumerate(lengths + n_accept):
        for got, want in zip(committed.k + committed.v, committed_x.k + committed_x.v):
            np.testing.assert_allclose(np.asarray(got[seq, :n]), np.asarray(want[seq, :n]), rtol=1e-5, atol=1e-6)


def test_pallas_speculative_greedy_output_equals_ar():
    """The decode loop end to end (PLD trees, kernels in interpret mode): the tokens equal plain AR
    decoding's, over rounds that keep several tokens (a repetitive prompt), so rows really move."""
    target = random_target(tiny_config(head_dim=64), seed=1, dtype="float32")
    target = Target(target.config, target.model.inference_layout(), target.tokenizer)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 128, size=6).tolist() * 3, rng.integers(0, 128, size=5).tolist()]
    run = functools.partial(generate, target, prompts, max_new_tokens=10, eos_token_ids=())
    reference = run(attn_impl="xla", mode="ar").tokens
    speculative = run(attn_impl="pallas", mode="pld")
    assert speculative.tokens == reference
    assert speculative.stats.tau > 1


def test_pallas_draft_trees_decode_what_xla_does_greedy_and_sampled():
    """A draft tree under the kernels (interpret mode): the draft's candidates from the head top-k
    kernel when greedy (output equal to AR) and from the race under the target's noise when
    sampling (the same tokens as impl "xla" for the same seed)."""
    target = random_target(tiny_config(head_dim=64), seed=1, dtype="float32")
    target = Target(target.config, target.model.inference_layout(), target.tokenizer)
    draft = init_draft(target, seed=2, config=DraftConfig(window=8))
    prompts = [np.random.default_rng(1).integers(0, 128, size=9).tolist()]
    run = functools.partial(generate, target, prompts, max_new_tokens=8, eos_token_ids=(), seed=3)
    assert run(attn_impl="pallas", mode="longspec", draft=draft, tree_widths=(2, 2)).tokens == run(mode="ar").tokens
    sampled = functools.partial(run, mode="longspec", draft=draft, tree_widths=(2, 2), temperature=1.0)
    assert sampled(attn_impl="pallas").tokens == sampled(attn_impl="xla").tokens


def test_pallas_ar_steps_with_fused_projections_equal_xla():
    """The one-token step with every projection as a fused kernel (interpret mode) decodes what the
    XLA path decodes."""
    target = random_target(tiny_config(head_dim=64), seed=3, dtype="float32")
    model = target.model.inference_layout()
    model.fused_projections = True
    fused = Target(target.config, model, target.tokenizer)
    prompts = [np.random.default_rng(1).integers(0, 128, size=7).tolist()]
    reference = generate(target, prompts, max_new_tokens=6, eos_token_ids=(), attn_impl="xla", mode="ar").tokens
    assert (
        generate(fused, prompts, max_new_tokens=6, eos_token_ids=(), attn_impl="pallas", mode="ar").tokens == reference
    )


@pytest.mark.parametrize("batch,tokens_per_row,kernels_per_layer", [(1, 1, 2), (2, 1, 0), (1, 5, 0)])
def test_residual_norm_kernels_decode_what_xla_norms_do(batch, tokens_per_row, kernels_per_layer, monkeypatch):
    """An AR step of one sequence with each residual add and its norm as one `residual_norm` kernel
    (interpret mode, two a layer) gives the logits and cache of XLA's add, statistics and scaling;
    a batch's step and a verified block keep XLA's (fewer kernels there)."""
    config = tiny_config(head_dim=64, num_heads=4, num_kv_heads=2, num_layers=2)
    model = random_target(config, seed=4, dtype="float32").model.inference_layout()
    rng = np.random.default_rng(4)
    model.norm.weight[...] = jnp.asarray(rng.uniform(0.5, 2.0, size=config.hidden_size), jnp.float32)  # not ones
    lengths = np.asarray([9, 3][:batch], np.int32)
    prompts = rng.integers(0, config.vocab_size, size=(batch, 10)).astype(np.int32)
    graphdef, params = nnx.split(model)
    _, cache = _prefill(graphdef, params, prompts, lengths, init_cache(config, batch, MAX_LEN, jnp.float32))
    t = tokens_per_row
    mask = np.tril(np.ones((batch, t, t), bool))
    tokens = rng.integers(0, config.vocab_size, size=(batch, t)).astype(np.int32)
    positions = (lengths[:, None] + np.arange(t)).astype(np.int32)

    calls, kernel = [], model_module.residual_norm
    monkeypatch.setattr(model_module, "residual_norm", lambda *args, **kw: calls.append(1) or kernel(*args, **kw))
    outputs = {}
    for norm_kernels in (True, False):
        model.norm_kernels = norm_kernels
        graphdef, params = nnx.split(model)

        def block(params, graphdef=graphdef):
            return nnx.merge(graphdef, params).forward_block(tokens, positions, mask, cache, attn_impl="pallas")

        calls.clear()
        outputs[norm_kernels] = jax.jit(block)(params)
        assert len(calls) == (kernels_per_layer * config.num_layers if norm_kernels else 0)
    (logits, verified, _), (logits_x, verified_x, _) = outputs[True], outputs[False]
    np.testing.assert_allclose(np.asarray(logits), np.asarray(logits_x), rtol=1e-5, atol=1e-5)
    for got, want in zip(verified.k + verified.v, verified_x.k + verified_x.v):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
