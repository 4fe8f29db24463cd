"""Tokenizers through transformers: from an HF checkpoint directory or from a GGUF's metadata.

Everything is read locally (`local_files_only`), so HF_HUB_OFFLINE=1 works. A GGUF's tokenizer is
built without torch (its metadata read with the gguf package, converted by transformers' vocabulary
converters), once per file, and then read from the on-disk cache (`gguf_cache`).
"""

from __future__ import annotations

from pathlib import Path

from longspec_jax.errors import UserError
from longspec_jax.gguf_cache import cached_gguf_tokenizer, converter_fingerprint


def load_tokenizer(path: str | Path):
    """The transformers tokenizer of an HF checkpoint directory or a `.gguf` file."""
    from transformers import AutoTokenizer

    path = Path(path)
    if path.is_file() and path.suffix.lower() == ".gguf":
        fingerprint = converter_fingerprint(__file__, "transformers", "tokenizers", "gguf")
        return cached_gguf_tokenizer(path, lambda: _convert_gguf_tokenizer(path), fingerprint)
    if path.is_dir():
        try:
            return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        except (OSError, ValueError) as e:
            raise UserError(
                f"no usable tokenizer in {path} ({e}): copy tokenizer.json / tokenizer_config.json there"
            ) from e
    raise UserError(f"tokenizer path {path} is neither an HF checkpoint directory nor a .gguf file")


def _convert_gguf_tokenizer(path: Path):
    # transformers' own GGUF tokenizer route (`from_pretrained(gguf_file=...)`) goes through its GGUF
    # weight loader, which needs torch; its vocabulary converters do not. So the metadata is read
    # with the gguf package and handed to those converters, and torch stays out of the install.
    from gguf import GGUFReader
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.ggml import GGUF_TO_FAST_CONVERTERS, GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer

    reader = GGUFReader(path)
    metadata = {name: field.contents() for name, field in reader.fields.items() if name.startswith("tokenizer.")}
    architecture = reader.fields["general.architecture"].contents()
    if architecture not in GGUF_TO_FAST_CONVERTERS or "tokenizer.ggml.tokens" not in metadata:
        raise UserError(
            f"{path} holds no tokenizer transformers can build (architecture {architecture!r}): "
            "pass an HF checkpoint directory with tokenizer.json instead"
        )
    sections = {
        section: {name: metadata[f"tokenizer.{key}"] for key, name in renames.items() if f"tokenizer.{key}" in metadata}
        for section, renames in GGUF_TOKENIZER_MAPPING.items()
    }
    backend, converter_kwargs = convert_gguf_tokenizer(architecture, sections["tokenizer"])
    config = sections["tokenizer_config"]
    tokens = sections["tokenizer"]["tokens"]
    # A GGUF names its special tokens by id. The converters' own guesses are overridden (the Llama
    # one names BOS as EOS: SmolLM2 would never stop); undeclared ones stay unset.
    special = {
        f"{role}_token": tokens[config[f"{role}_token_id"]] if config.get(f"{role}_token_id") is not None else None
        for role in ("bos", "eos", "unk", "pad")
    }
    return PreTrainedTokenizerFast(tokenizer_object=backend, **{**converter_kwargs, **config, **special})


def encode_prompt(tokenizer, text: str, *, chat: bool) -> list[int]:
    """Token ids of a prompt; with chat=True it is one user turn in the chat template, ready for the
    assistant's answer."""
    if not text.strip():
        raise UserError("the prompt is empty: give a prompt file with some text in it")
    if not chat:
        return list(tokenizer.encode(text))
    if not tokenizer.chat_template:
        raise UserError("this target's tokenizer has no chat template: run without --chat")
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
    )
    # The template already holds the special tokens (BOS included where the model uses one).
    return list(tokenizer.encode(rendered, add_special_tokens=False))


def decode(tokenizer, ids: list[int]) -> str:
    """Text of generated ids, special tokens left out."""
    return tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
