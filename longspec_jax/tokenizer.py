"""Tokenizers through transformers: from an HF checkpoint directory or from a GGUF's metadata.

Everything is read locally (`local_files_only`), so HF_HUB_OFFLINE=1 works. A GGUF's tokenizer is
converted once per file and then read from the on-disk cache (`gguf_cache`).
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
        fingerprint = converter_fingerprint(__file__, "transformers", "tokenizers")
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
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    _fix_gguf_special_tokens(tokenizer)
    return tokenizer


def _fix_gguf_special_tokens(tokenizer) -> None:
    # transformers' GGUF Llama tokenizer converter names the BOS token as EOS too (SmolLM2 would
    # never stop); the ids it read from the metadata are right, so the tokens are set from them.
    for role in ("bos", "eos"):
        token_id = tokenizer.init_kwargs.get(f"{role}_token_id")
        if token_id is not None and getattr(tokenizer, f"{role}_token_id") != token_id:
            setattr(tokenizer, f"{role}_token", tokenizer.convert_ids_to_tokens(int(token_id)))


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
