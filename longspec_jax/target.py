"""`Target`: the loaded target model with its config and tokenizer; `load_target`, `random_target`."""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from longspec_jax.checkpoint_hf import load_hf_model, model_from_hf_tensors
from longspec_jax.config import ModelConfig
from longspec_jax.errors import UserError
from longspec_jax.model import Transformer, small_rows_for

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


@functools.partial(jax.jit, static_argnums=0)
def _forward_logits(graphdef, params, tokens):
    # Parameters come in as arguments: closed over they would be baked into the program.
    return nnx.merge(graphdef, params).forward_logits(tokens)


class Target:
    """A target model ready to run: `.config`, `.model` (Transformer: in the layout it was loaded in,
    the inference layout once `decode_model` or a Generator has used it), `.tokenizer` (or None), `.dtype`,
    `.shipped_draft`: the directory of the draft this project ships for it (None for most targets;
    `load_target` sets it for a GGUF whose bytes are the embedded SmolLM2's, whatever its path), and
    `.shipped_sampling_draft`: the one it ships for sampling (None: the shipped draft samples too)."""

    def __init__(
        self,
        config: ModelConfig,
        model: Transformer,
        tokenizer=None,
        shipped_draft: Path | None = None,
        shipped_sampling_draft: Path | None = None,
    ):
        self.config = config
        self.model = model
        self.tokenizer = tokenizer
        self.dtype = model.dtype
        self.shipped_draft = shipped_draft
        self.shipped_sampling_draft = shipped_sampling_draft

    def decode_model(self) -> Transformer:
        """`.model` in its inference layout (`Transformer.inference_layout`), packed in place on
        first use (`Transformer.pack_in_place`): the target lets go of the layout it was loaded in,
        a layer at a time, so it holds its weights once, at every moment (a 7B target kept in both
        layouts would need twice its weights' memory). Every Generator of this target shares it;
        packed again when `.model` or any of its parameter arrays was replaced (e.g. by
        `nnx.update`). Training and checkpoint writing want the loaded layout: load the target
        again for them."""
        if getattr(self, "_decode_model_of", None) != _identity(self.model):
            self.model.pack_in_place(small_rows_for(jax.default_backend()))
            self._decode_model_of = _identity(self.model)
        return self.model

    def forward_logits(self, tokens) -> jax.Array:
        """Full causal forward, no cache: int32[B, L] -> float32[B, L, V] (jitted per shape)."""
        graphdef, params = nnx.split(self.model)
        return _forward_logits(graphdef, params, jnp.asarray(tokens, jnp.int32))


def _identity(model: Transformer) -> tuple:
    """What `Target.decode_model` compares to tell whether `.model` changed since it last ran."""
    return id(model), tuple(id(x) for x in jax.tree.leaves(nnx.state(model)))


def load_target(path: str | Path | None, *, dtype="bfloat16") -> Target:
    """An HF checkpoint directory, a `.gguf` file, or None for the embedded SmolLM2-135M-Instruct."""
    if path is None:
        from longspec_jax.embedded import smollm2_gguf_path

        return _load_gguf(smollm2_gguf_path(), dtype)
    path = Path(path)
    if not path.exists():
        raise UserError(f"target path {path} does not exist: pass an HF checkpoint directory or a .gguf file")
    if path.suffix.lower() == ".gguf":
        return _load_gguf(path, dtype)
    if not path.is_dir():
        raise UserError(
            f"target {path} is neither a directory nor a .gguf file: pass an HF checkpoint directory or a .gguf file"
        )
    config, model = load_hf_model(path, dtype)
    return Target(config, model, _hf_tokenizer(path))


def random_target(config: ModelConfig, *, seed: int = 0, dtype="float32") -> Target:
    """A target with random weights (std 0.02, norms 1, biases 0), drawn on the default device."""
    return Target(config, Transformer(config, dtype=dtype, rngs=nnx.Rngs(seed)))


def _load_gguf(path: Path, dtype) -> Target:
    from longspec_jax.checkpoint_gguf import read_gguf
    from longspec_jax.embedded import shipped_draft_for_gguf, shipped_sampling_draft_for_gguf
    from longspec_jax.tokenizer import load_tokenizer

    hf_config, tensors = read_gguf(path)
    config = ModelConfig.from_hf_dict(hf_config)
    model = model_from_hf_tensors(config, tensors, dtype)
    # Matched by content: the embedded SmolLM2 copied or linked elsewhere still gets its draft.
    return Target(
        config,
        model,
        load_tokenizer(path),
        shipped_draft=shipped_draft_for_gguf(path),
        shipped_sampling_draft=shipped_sampling_draft_for_gguf(path),
    )


def _hf_tokenizer(directory: Path):
    if not any((directory / name).is_file() for name in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(directory)
