"""load_target on bad input: one UserError, one line, naming the fix. Plus the torch-free round trip."""

import json

import numpy as np
import pytest

from longspec_jax import UserError, load_target, random_target
from longspec_jax.checkpoint_hf import SHARD_INDEX
from tests.tiny_models import save_tiny_checkpoint, tiny_config


def _load_error(path) -> str:
    with pytest.raises(UserError) as info:
        load_target(path, dtype="float32")
    message = str(info.value)
    assert "\n" not in message
    return message


def _edit_config(directory, **changes):
    path = directory / "config.json"
    hf = json.loads(path.read_text())
    hf.update(changes)
    path.write_text(json.dumps(hf))


@pytest.fixture()
def checkpoint(tmp_path):
    return save_tiny_checkpoint(tmp_path / "ckpt", tiny_config(), seed=4)


def test_round_trip_of_our_own_checkpoint(checkpoint):
    loaded = load_target(checkpoint, dtype="float32")
    original = random_target(tiny_config(), seed=4, dtype="float32")
    tokens = np.arange(10, dtype=np.int32)[None] * 7 % 128
    ours, reference = loaded.forward_logits(tokens), original.forward_logits(tokens)
    np.testing.assert_array_equal(np.asarray(ours), np.asarray(reference))


def test_missing_path(tmp_path):
    assert "does not exist" in _load_error(tmp_path / "nowhere")


def test_missing_gguf_file(tmp_path):
    assert "does not exist" in _load_error(tmp_path / "model.gguf")


def test_file_that_is_not_a_checkpoint(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"\0")
    assert "neither a directory nor a .gguf" in _load_error(path)


def test_directory_without_config(tmp_path):
    assert "no config.json" in _load_error(tmp_path)


def test_directory_without_weights(checkpoint):
    (checkpoint / "model.safetensors").unlink()
    assert "no weights" in _load_error(checkpoint)


def test_shard_index_naming_a_missing_shard(checkpoint):
    (checkpoint / "model.safetensors").rename(checkpoint / "model-00001-of-00002.safetensors")
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (checkpoint / SHARD_INDEX).write_text(json.dumps(index))
    assert "model-00002-of-00002.safetensors" in _load_error(checkpoint)


def test_unsupported_architecture(checkpoint):
    _edit_config(checkpoint, model_type="gpt2")
    assert "unsupported architecture" in _load_error(checkpoint)


def test_tensor_shape_not_matching_config(checkpoint):
    _edit_config(checkpoint, intermediate_size=80)
    message = _load_error(checkpoint)
    assert "model.layers.0.mlp.gate_proj.weight" in message and "(80, 64)" in message


def test_tensor_missing_for_config(checkpoint):
    _edit_config(checkpoint, num_hidden_layers=3)
    assert "model.layers.2.input_layernorm.weight" in _load_error(checkpoint)


def test_untied_config_needs_an_lm_head(tmp_path):
    directory = save_tiny_checkpoint(tmp_path / "tied", tiny_config(tie_word_embeddings=True))
    _edit_config(directory, tie_word_embeddings=False)
    assert "lm_head.weight" in _load_error(directory)


@pytest.mark.parametrize(
    "text,message",
    [("{not json", "is not valid JSON"), ('["a list"]', "not an object"), ("\xff\xfe", "is not valid JSON")],
    ids=["broken", "a-list", "not-utf8"],
)
def test_config_json_that_is_not_a_json_object(checkpoint, text, message):
    (checkpoint / "config.json").write_bytes(text.encode("latin-1"))
    error = _load_error(checkpoint)
    assert message in error and "config.json" in error


def test_config_json_missing_a_required_key(checkpoint):
    path = checkpoint / "config.json"
    hf = json.loads(path.read_text())
    del hf["num_attention_heads"]
    path.write_text(json.dumps(hf))
    assert "lacks num_attention_heads" in _load_error(checkpoint)


def _truncate(path, keep):
    path.write_bytes(path.read_bytes()[:keep])


@pytest.mark.parametrize(
    "damage",
    [
        lambda f: _truncate(f, f.stat().st_size // 2),
        lambda f: _truncate(f, 5),
        lambda f: _truncate(f, 0),
        lambda f: f.write_bytes(np.random.default_rng(0).bytes(f.stat().st_size)),
    ],
    ids=["half", "five-bytes", "empty", "garbage"],
)
def test_damaged_safetensors(checkpoint, damage):
    damage(checkpoint / "model.safetensors")
    message = _load_error(checkpoint)
    assert "model.safetensors is not a readable safetensors file" in message and "again" in message


def test_shard_index_that_is_not_json(checkpoint):
    (checkpoint / SHARD_INDEX).write_text("{")
    assert "is not valid JSON" in _load_error(checkpoint)


@pytest.mark.parametrize("keep", [0, 100, 2**20, -1000], ids=["empty", "100-bytes", "first-megabyte", "tail-cut"])
def test_truncated_gguf(tmp_path, monkeypatch, keep):
    from longspec_jax import gguf_cache
    from longspec_jax.embedded import smollm2_gguf_path

    monkeypatch.setenv(gguf_cache.CACHE_ENV, str(tmp_path / "cache"))
    path = tmp_path / "cut.gguf"
    path.write_bytes(smollm2_gguf_path().read_bytes()[:keep])
    message = _load_error(path)
    assert "cut.gguf is not a readable GGUF file" in message and "truncated" in message
