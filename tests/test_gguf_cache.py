"""The on-disk cache of GGUF conversions: a tiny GGUF (Q4_1/Q8_0 tensors, a byte-level BPE tokenizer
with a chat template, like SmolLM2's) converted once, then served from the cache exactly as converted;
damaged, stale and half-written entries are never served."""

from __future__ import annotations

import json
import os
import shutil
import time

import gguf
import numpy as np
import pytest
from tokenizers.pre_tokenizers import ByteLevel

from longspec_jax import checkpoint_gguf, gguf_cache, tokenizer
from longspec_jax.checkpoint_gguf import read_gguf
from longspec_jax.tokenizer import encode_prompt, load_tokenizer

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN = 64, 2, 1, 32, 32
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "a t", "Ġ c", "Ġc at"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TEXT = "the cat sat on the mat, then the cat ate: 3.14!"


def write_tiny_gguf(path, seed: int) -> None:
    """A one-layer Llama GGUF with SmolLM2's token setup (BOS <|im_start|>, EOS <|im_end|>)."""
    tokens = SPECIALS + sorted(ByteLevel.alphabet()) + ["Ġt", "he", "Ġthe", "at", "Ġc", "Ġcat"]
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(2048)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL] * len(SPECIALS) + [gguf.TokenType.NORMAL] * (len(tokens) - 3))
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_chat_template(CHAT_TEMPLATE)

    def rand(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    # SmolLM2's quantisations: float32 values that float16/bfloat16 storage could not hold exactly.
    for name, value, qtype in [
        ("token_embd.weight", rand(len(tokens), HIDDEN), gguf.GGMLQuantizationType.Q4_1),
        ("blk.0.attn_v.weight", rand(KV_HEADS * HEAD_DIM, HIDDEN), gguf.GGMLQuantizationType.Q8_0),
    ]:
        w.add_tensor(name, gguf.quants.quantize(value, qtype), raw_dtype=qtype)
    w.add_tensor("blk.0.attn_q.weight", rand(HEADS * HEAD_DIM, HIDDEN))
    w.add_tensor("blk.0.attn_k.weight", rand(KV_HEADS * HEAD_DIM, HIDDEN))
    w.add_tensor("blk.0.attn_output.weight", rand(HIDDEN, HEADS * HEAD_DIM))
    w.add_tensor("blk.0.ffn_gate.weight", rand(FFN, HIDDEN))
    w.add_tensor("blk.0.ffn_up.weight", rand(FFN, HIDDEN))
    w.add_tensor("blk.0.ffn_down.weight", rand(HIDDEN, FFN))
    for norm in ("blk.0.attn_norm", "blk.0.ffn_norm", "output_norm"):
        w.add_tensor(f"{norm}.weight", rand(HIDDEN))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_tiny_gguf(path, seed=0)
    return path


@pytest.fixture(scope="module")
def uncached_tensors(tiny_gguf):
    return checkpoint_gguf._convert_gguf(gguf, tiny_gguf)


@pytest.fixture(scope="module")
def uncached_tokenizer(tiny_gguf):
    return tokenizer._convert_gguf_tokenizer(tiny_gguf)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(gguf_cache.CACHE_ENV, str(tmp_path / "cache"))
    return tmp_path / "cache"


class Conversions:
    """Counts calls of a module's conversion function while still converting."""

    def __init__(self, monkeypatch, module, name):
        original = getattr(module, name)
        self.calls = 0

        def counted(*args):
            self.calls += 1
            return original(*args)

        monkeypatch.setattr(module, name, counted)


@pytest.fixture
def tensor_conversions(monkeypatch):
    return Conversions(monkeypatch, checkpoint_gguf, "_convert_gguf")


@pytest.fixture
def tokenizer_conversions(monkeypatch):
    return Conversions(monkeypatch, tokenizer, "_convert_gguf_tokenizer")


def assert_same_tensors(got, expected):
    (config, tensors), (expected_config, expected_tensors) = got, expected
    assert json.dumps(config, sort_keys=True) == json.dumps(expected_config, sort_keys=True)  # types too
    assert sorted(tensors) == sorted(expected_tensors)
    for name, value in expected_tensors.items():
        assert tensors[name].dtype == np.float32 and tensors[name].shape == value.shape, name
        np.testing.assert_array_equal(tensors[name], value, err_msg=name)


def tensor_entry(cache_dir):
    (entry,) = (cache_dir / "gguf_tensors").iterdir()
    return entry


def test_tensors_are_converted_once_then_read_back_exactly(cache_dir, tiny_gguf, uncached_tensors, tensor_conversions):
    # The fixture's file really needs float32 storage: its Q4_1 values do not survive float16.
    embedding = uncached_tensors[1]["model.embed_tokens.weight"]
    assert not np.array_equal(embedding.astype(np.float16).astype(np.float32), embedding)

    assert_same_tensors(read_gguf(tiny_gguf), uncached_tensors)
    assert tensor_conversions.calls == 1
    entry = tensor_entry(cache_dir)
    assert entry.name == gguf_cache.file_sha256(tiny_gguf)
    assert entry.stat().st_mode & 0o777 == entry.parent.stat().st_mode & 0o777  # not private to one user
    assert_same_tensors(read_gguf(tiny_gguf), uncached_tensors)
    assert tensor_conversions.calls == 1


def test_tokenizer_is_converted_once_then_read_back_equal(
    cache_dir, tiny_gguf, uncached_tokenizer, tokenizer_conversions
):
    load_tokenizer(tiny_gguf)
    cached = load_tokenizer(tiny_gguf)
    assert tokenizer_conversions.calls == 1
    assert cached.get_vocab() == uncached_tokenizer.get_vocab()
    # The BOS/EOS fix survives: transformers' converter alone would make <|im_start|> the EOS too.
    assert (cached.bos_token, cached.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert (cached.bos_token_id, cached.eos_token_id) == (1, 2)
    assert cached.chat_template == uncached_tokenizer.chat_template == CHAT_TEMPLATE
    for chat in (False, True):
        ids = encode_prompt(cached, TEXT, chat=chat)
        assert ids == encode_prompt(uncached_tokenizer, TEXT, chat=chat)
        assert cached.decode(ids) == uncached_tokenizer.decode(ids)
    assert len(encode_prompt(cached, TEXT, chat=False)) < len(TEXT)  # the merges are applied


def test_second_load_target_converts_nothing(cache_dir, tiny_gguf, tensor_conversions, tokenizer_conversions):
    from longspec_jax.target import load_target

    first = load_target(tiny_gguf, dtype="float32")
    second = load_target(tiny_gguf, dtype="float32")
    assert (tensor_conversions.calls, tokenizer_conversions.calls) == (1, 1)
    assert second.tokenizer.eos_token_id == second.config.eos_token_ids[0] == 2
    tokens = [encode_prompt(second.tokenizer, TEXT, chat=True)]
    np.testing.assert_array_equal(second.forward_logits(tokens), first.forward_logits(tokens))


def truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def garble(path):
    # Same size, so only reading it shows the damage.
    path.write_bytes(b"\xff" * path.stat().st_size)


@pytest.mark.parametrize(
    "damage",
    [
        lambda entry: truncate(entry / gguf_cache.TENSORS_FILE),
        lambda entry: garble(entry / gguf_cache.TENSORS_FILE),
        lambda entry: (entry / gguf_cache.TENSORS_FILE).unlink(),
        lambda entry: (entry / gguf_cache.MANIFEST).write_text("{not json"),
        lambda entry: (entry / gguf_cache.MANIFEST).unlink(),
    ],
    ids=["truncated", "garbled", "deleted", "bad-manifest", "no-manifest"],
)
def test_damaged_tensor_entry_is_rebuilt(cache_dir, tiny_gguf, uncached_tensors, tensor_conversions, damage):
    read_gguf(tiny_gguf)
    damage(tensor_entry(cache_dir))
    with pytest.warns(UserWarning, match="rebuilding the cache entry"):
        assert_same_tensors(read_gguf(tiny_gguf), uncached_tensors)
    assert tensor_conversions.calls == 2
    assert_same_tensors(read_gguf(tiny_gguf), uncached_tensors)  # the rebuilt entry serves
    assert tensor_conversions.calls == 2


@pytest.mark.parametrize(
    "damage",
    # A truncated template would still load, as a different template: only its size tells.
    [lambda entry: garble(entry / "tokenizer.json"), lambda entry: truncate(entry / "chat_template.jinja")],
    ids=["garbled-vocabulary", "truncated-template"],
)
def test_damaged_tokenizer_entry_is_rebuilt(cache_dir, tiny_gguf, uncached_tokenizer, tokenizer_conversions, damage):
    load_tokenizer(tiny_gguf)
    (entry,) = (cache_dir / "gguf_tokenizer").iterdir()
    damage(entry)
    with pytest.warns(UserWarning, match="rebuilding the cache entry"):
        rebuilt = load_tokenizer(tiny_gguf)
    assert rebuilt.chat_template == CHAT_TEMPLATE
    assert encode_prompt(rebuilt, TEXT, chat=True) == encode_prompt(uncached_tokenizer, TEXT, chat=True)
    assert load_tokenizer(tiny_gguf).chat_template == CHAT_TEMPLATE
    assert tokenizer_conversions.calls == 2


def test_entry_of_other_converter_code_is_replaced(cache_dir, tiny_gguf, uncached_tensors, tensor_conversions):
    read_gguf(tiny_gguf)
    manifest_path = tensor_entry(cache_dir) / gguf_cache.MANIFEST
    manifest = json.loads(manifest_path.read_text())
    manifest["fingerprint"] = "an older checkpoint_gguf.py"
    manifest_path.write_text(json.dumps(manifest))
    assert_same_tensors(read_gguf(tiny_gguf), uncached_tensors)
    assert tensor_conversions.calls == 2
    assert json.loads(manifest_path.read_text())["fingerprint"] != manifest["fingerprint"]
    assert [p.name for p in (cache_dir / "gguf_tensors").iterdir()] == [gguf_cache.file_sha256(tiny_gguf)]


def test_interrupted_write_leaves_no_entry(cache_dir, tiny_gguf, uncached_tensors, tensor_conversions, monkeypatch):
    def interrupted_save(converted, folder):
        (folder / gguf_cache.TENSORS_FILE).write_bytes(b"the first bytes of the tensors")
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(gguf_cache, "_save_tensors", interrupted_save)
        with pytest.raises(KeyboardInterrupt):
            read_gguf(tiny_gguf)
    assert list((cache_dir / "gguf_tensors").iterdir()) == []
    assert_same_tensors(read_gguf(tiny_gguf), uncached_tensors)
    read_gguf(tiny_gguf)
    assert tensor_conversions.calls == 2


def test_temporaries_of_killed_writes_are_never_read_and_get_removed(
    cache_dir, tiny_gguf, uncached_tensors, tensor_conversions
):
    folder = cache_dir / "gguf_tensors"
    killed, live = folder / ".tmp-killed", folder / ".tmp-live"
    for temp in (killed, live):
        temp.mkdir(parents=True)
        (temp / gguf_cache.TENSORS_FILE).write_bytes(b"half")
    two_hours_ago = time.time() - 7200
    os.utime(killed, (two_hours_ago, two_hours_ago))
    assert_same_tensors(read_gguf(tiny_gguf), uncached_tensors)
    assert tensor_conversions.calls == 1
    assert not killed.exists() and live.exists()  # a recent one may be another process writing


def test_entries_are_keyed_by_content_not_name_or_mtime(cache_dir, tiny_gguf, tmp_path, tensor_conversions):
    copy = tmp_path / "elsewhere" / "renamed.gguf"
    copy.parent.mkdir()
    shutil.copy(tiny_gguf, copy)
    first = read_gguf(tiny_gguf)
    assert_same_tensors(read_gguf(copy), first)
    assert tensor_conversions.calls == 1

    # Other weights of the same size under the same name and mtime, as `cp -p` would leave them.
    stat = copy.stat()
    write_tiny_gguf(copy, seed=1)
    os.utime(copy, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert copy.stat().st_size == stat.st_size
    second = read_gguf(copy)
    assert tensor_conversions.calls == 2
    assert_same_tensors(second, checkpoint_gguf._convert_gguf(gguf, copy))
    assert not np.array_equal(second[1]["model.norm.weight"], first[1]["model.norm.weight"])


def test_unwritable_cache_only_warns(tmp_path, monkeypatch, tiny_gguf, uncached_tensors):
    (tmp_path / "a_file").write_text("not a folder")
    monkeypatch.setenv(gguf_cache.CACHE_ENV, str(tmp_path / "a_file"))
    with pytest.warns(UserWarning, match="could not cache .* LONGSPEC_CACHE"):
        assert_same_tensors(read_gguf(tiny_gguf), uncached_tensors)


def test_default_location_is_under_the_home_cache(monkeypatch, tmp_path):
    monkeypatch.delenv(gguf_cache.CACHE_ENV, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert gguf_cache.cache_root() == tmp_path / ".cache" / "longspec_jax"


def test_same_size_damage_inside_the_tensors_is_caught(cache_dir, tiny_gguf, uncached_tensors, tensor_conversions):
    read_gguf(tiny_gguf)
    tensors_file = tensor_entry(cache_dir) / gguf_cache.TENSORS_FILE
    data = bytearray(tensors_file.read_bytes())
    data[-8:] = bytes(255 - b for b in data[-8:])  # the last weights' bytes, inside the tensor data
    tensors_file.write_bytes(bytes(data))
    # Without the checksum this would be served: the file still loads, with a different weight.
    _, damaged = gguf_cache._load_tensors(tensors_file.parent)
    assert any(not np.array_equal(damaged[n], v, equal_nan=True) for n, v in uncached_tensors[1].items())

    with pytest.warns(UserWarning, match="model.safetensors does not match its checksum"):
        assert_same_tensors(read_gguf(tiny_gguf), uncached_tensors)
    assert tensor_conversions.calls == 2
    assert_same_tensors(read_gguf(tiny_gguf), uncached_tensors)
    assert tensor_conversions.calls == 2


def test_manifest_lists_every_file_with_size_and_checksum(cache_dir, tiny_gguf):
    load_tokenizer(tiny_gguf)
    (entry,) = (cache_dir / "gguf_tokenizer").iterdir()
    files = json.loads((entry / gguf_cache.MANIFEST).read_text())["files"]
    on_disk = {p.name for p in entry.iterdir()} - {gguf_cache.MANIFEST}
    assert set(files) == on_disk and "tokenizer.json" in on_disk
    for name, record in files.items():
        assert record["size"] == (entry / name).stat().st_size
        assert len(record["xxh3_128"]) == 32


def test_entry_with_an_older_manifest_layout_is_rebuilt_quietly(
    cache_dir, tiny_gguf, uncached_tensors, tensor_conversions, recwarn
):
    read_gguf(tiny_gguf)
    manifest_path = tensor_entry(cache_dir) / gguf_cache.MANIFEST
    manifest = json.loads(manifest_path.read_text())
    # The first layout: sizes only, no format number.
    old = {"fingerprint": manifest["fingerprint"], "files": {n: f["size"] for n, f in manifest["files"].items()}}
    manifest_path.write_text(json.dumps(old))
    assert_same_tensors(read_gguf(tiny_gguf), uncached_tensors)
    assert tensor_conversions.calls == 2
    assert not [w for w in recwarn if "rebuilding" in str(w.message)]
