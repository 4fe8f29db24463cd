"""Logits parity with transformers (torch CPU, float32) for tiny random HF checkpoints."""

import json

import numpy as np
import pytest

from longspec_jax import load_target
from longspec_jax.checkpoint_hf import SHARD_INDEX
from tests.tiny_models import HF_VARIANTS, TINY, hf_logits, rewrite_config_released_form, save_tiny_hf_model

TOL = 1e-4


def _tokens(seed=0, batch=2, length=24):
    return np.random.default_rng(seed).integers(0, TINY["vocab_size"], size=(batch, length), dtype=np.int32)


def _assert_parity(ours, theirs):
    # The check only means something if the logits are far from constant.
    assert np.std(theirs) > 0.3
    np.testing.assert_allclose(np.asarray(ours), theirs, atol=TOL, rtol=TOL)


@pytest.mark.parametrize("variant", sorted(HF_VARIANTS))
def test_logits_match_transformers(tmp_path, variant):
    directory = save_tiny_hf_model(tmp_path / variant, variant)
    target = load_target(directory, dtype="float32")
    tokens = _tokens()
    _assert_parity(target.forward_logits(tokens), hf_logits(directory, tokens))
    assert target.tokenizer is None  # save_pretrained of a bare model writes no tokenizer


def test_released_config_form_loads_the_same(tmp_path):
    directory = save_tiny_hf_model(tmp_path / "m", "llama3_rope")
    tokens = _tokens(1)
    before = load_target(directory, dtype="float32")
    rewritten = rewrite_config_released_form(directory)
    assert "rope_parameters" not in rewritten and rewritten["rope_scaling"]["rope_type"] == "llama3"
    after = load_target(directory, dtype="float32")
    assert after.config == before.config
    np.testing.assert_array_equal(np.asarray(after.forward_logits(tokens)), np.asarray(before.forward_logits(tokens)))


def test_sharded_checkpoint(tmp_path):
    directory = save_tiny_hf_model(tmp_path / "m", "qwen2_bias", max_shard_size="40KB")
    shards = set(json.loads((directory / SHARD_INDEX).read_text())["weight_map"].values())
    assert len(shards) > 1
    tokens = _tokens(2)
    _assert_parity(load_target(directory, dtype="float32").forward_logits(tokens), hf_logits(directory, tokens))


def test_bfloat16_checkpoint_and_bfloat16_params(tmp_path):
    directory = save_tiny_hf_model(tmp_path / "m", "llama_gqa", torch_dtype="bfloat16")
    tokens = _tokens(3)
    theirs = hf_logits(directory, tokens)  # bf16 weights upcast to float32
    _assert_parity(load_target(directory, dtype="float32").forward_logits(tokens), theirs)
    bf16 = load_target(directory, dtype="bfloat16")
    assert bf16.dtype == np.dtype("bfloat16")
    ours = np.asarray(bf16.forward_logits(tokens))
    assert ours.dtype == np.float32
    # bf16 weights and activations: ~3 significant digits per op, so a loose bound against the
    # logits' spread (a wrong layer or head gives errors of the order of the spread itself).
    assert np.max(np.abs(ours - theirs)) < 0.25 * np.std(theirs)
    assert np.mean(np.abs(ours - theirs)) < 0.03 * np.std(theirs)
