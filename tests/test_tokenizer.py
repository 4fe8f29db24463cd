"""The SmolLM2 tokenizer from its GGUF: special tokens, chat template, round trips; HF directories."""

from __future__ import annotations

import os
import subprocess
import sys

import gguf
import jinja2
import pytest

from longspec_jax.embedded import smollm2_gguf_path
from longspec_jax.errors import UserError
from longspec_jax.tokenizer import decode, encode_prompt, load_tokenizer

# The tests share the slow tokenizer fixture: one xdist worker runs them all.
pytestmark = pytest.mark.xdist_group("smollm2_tokenizer")


@pytest.fixture(scope="module")
def gguf_metadata():
    reader = gguf.GGUFReader(smollm2_gguf_path())
    keys = ("tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id", "tokenizer.chat_template")
    return {key: reader.fields[key].contents() for key in keys}


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    return load_tokenizer(smollm2_gguf_path())


def test_special_tokens_come_from_the_gguf_metadata(smollm2_tokenizer, gguf_metadata):
    assert smollm2_tokenizer.bos_token_id == gguf_metadata["tokenizer.ggml.bos_token_id"]
    assert smollm2_tokenizer.eos_token_id == gguf_metadata["tokenizer.ggml.eos_token_id"]
    assert smollm2_tokenizer.eos_token == "<|im_end|>"  # where SmolLM2-Instruct's answers stop


def test_gguf_tokenizer_equals_transformers_own_gguf_route(smollm2_tokenizer):
    # transformers' route needs torch (a dev dependency): the reference here, never at run time.
    pytest.importorskip("torch", reason="the reference route needs torch: install the dev extra")
    from transformers import AutoTokenizer

    path = smollm2_gguf_path()
    reference = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    assert smollm2_tokenizer.backend_tokenizer.to_str() == reference.backend_tokenizer.to_str()
    assert smollm2_tokenizer.chat_template == reference.chat_template
    text = "Long documents, <|im_end|> inside text, and tabs\tstay tokens."
    assert smollm2_tokenizer.encode(text) == reference.encode(text)
    assert encode_prompt(smollm2_tokenizer, text, chat=True) == encode_prompt(reference, text, chat=True)


_TORCHLESS_LOAD = """
import sys
sys.modules["torch"] = None  # as if torch were not installed: importing it fails
from longspec_jax.embedded import smollm2_gguf_path
from longspec_jax.tokenizer import load_tokenizer
tokenizer = load_tokenizer(smollm2_gguf_path())
print(tokenizer.encode("a prompt without torch"), tokenizer.eos_token_id)
"""


def test_gguf_tokenizer_loads_without_torch(smollm2_tokenizer, tmp_path):
    env = {**os.environ, "LONGSPEC_CACHE": str(tmp_path)}  # an empty cache: the conversion runs
    out = subprocess.run([sys.executable, "-c", _TORCHLESS_LOAD], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "PyTorch was not found" not in out.stderr  # transformers' notice is not ours to show
    expected = f"{smollm2_tokenizer.encode('a prompt without torch')} {smollm2_tokenizer.eos_token_id}"
    assert out.stdout.strip() == expected


def test_gguf_without_a_vocabulary_is_a_user_error(tmp_path):
    path = tmp_path / "no_vocab.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UserError, match="no tokenizer"):
        load_tokenizer(path)


def test_chat_prompt_is_the_gguf_template_rendered(smollm2_tokenizer, gguf_metadata):
    text = "Summarise: the cat sat on the mat."
    ids = encode_prompt(smollm2_tokenizer, text, chat=True)
    # Rendered here with plain jinja2 from the template stored in the GGUF, independently of transformers.
    template = jinja2.Environment().from_string(gguf_metadata["tokenizer.chat_template"])
    expected = template.render(messages=[{"role": "user", "content": text}], add_generation_prompt=True)
    assert smollm2_tokenizer.decode(ids, skip_special_tokens=False) == expected
    assert ids.count(smollm2_tokenizer.convert_tokens_to_ids("<|im_start|>")) == 3  # system, user, assistant
    assert expected.endswith("<|im_start|>assistant\n")


def test_plain_prompt_round_trips(smollm2_tokenizer):
    text = "def area(r):\n    return 3.14159 * r ** 2  # héllo, 日本\n"
    ids = encode_prompt(smollm2_tokenizer, text, chat=False)
    assert all(isinstance(i, int) for i in ids)
    assert decode(smollm2_tokenizer, ids) == text
    assert decode(smollm2_tokenizer, ids + [smollm2_tokenizer.eos_token_id]) == text


def test_empty_prompt_is_a_user_error(smollm2_tokenizer):
    with pytest.raises(UserError, match="prompt is empty"):
        encode_prompt(smollm2_tokenizer, " \n", chat=False)


def test_hf_directory_tokenizer(smollm2_tokenizer, tmp_path):
    smollm2_tokenizer.save_pretrained(tmp_path / "with_template")
    loaded = load_tokenizer(tmp_path / "with_template")
    text = "A long document about tokenizers."
    assert encode_prompt(loaded, text, chat=True) == encode_prompt(smollm2_tokenizer, text, chat=True)
    assert loaded.eos_token_id == smollm2_tokenizer.eos_token_id

    loaded.chat_template = None
    with pytest.raises(UserError, match="no chat template"):
        encode_prompt(loaded, text, chat=True)


def test_bad_paths_are_user_errors(tmp_path):
    with pytest.raises(UserError, match="neither"):
        load_tokenizer(tmp_path / "absent")
    with pytest.raises(UserError, match="no usable tokenizer"):
        load_tokenizer(tmp_path)
