"""Tiny models for tests: random HF checkpoints saved with transformers, and a tiny ModelConfig.

HF weights are redrawn with std 0.2 (norm weights around 1, biases non-zero) instead of HF's
0.02 / ones / zeros, so logits are O(1) and a wrong bias, norm or rotation shows up in parity.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from longspec_jax.config import ModelConfig

TINY = dict(
    vocab_size=160,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
)

# variant name -> (model_type, extra config kwargs); rope_parameters is the transformers 5 form.
HF_VARIANTS = {
    "llama_gqa": ("llama", dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    "llama_linear_rope": ("llama", dict(rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0})),
    "llama3_rope": (
        "llama",
        dict(
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        ),
    ),
    "llama_tied": ("llama", dict(tie_word_embeddings=True, num_key_value_heads=4)),
    "qwen2_bias": ("qwen2", dict(rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
}


def save_tiny_hf_model(
    directory: str | Path,
    variant: str,
    *,
    seed: int = 0,
    max_shard_size: str | None = None,
    torch_dtype: str = "float32",
) -> Path:
    """Build a tiny random HF model of `variant` (a key of HF_VARIANTS), save it with
    save_pretrained (weights in `torch_dtype`) into `directory` and return the path."""
    import torch
    import transformers

    model_type, extra = HF_VARIANTS[variant]
    kwargs = {**TINY, **extra}
    if model_type == "llama":
        config, cls = transformers.LlamaConfig(**kwargs), transformers.LlamaForCausalLM
    else:
        config, cls = transformers.Qwen2Config(**kwargs), transformers.Qwen2ForCausalLM
    torch.manual_seed(seed)
    model = cls(config).to(torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(0.2 * torch.randn_like(p))
    model = model.to(getattr(torch, torch_dtype))
    directory = Path(directory)
    save_kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(directory, **save_kwargs)
    return directory


def hf_logits(directory: str | Path, tokens) -> numpy.ndarray:  # noqa: F821
    """float32 logits [B, L, V] of the saved HF model at `directory` for token ids [B, L] (torch CPU)."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.as_tensor(tokens, dtype=torch.long)).logits.numpy()


def rewrite_config_released_form(directory: str | Path) -> dict:
    """Rewrite a transformers-5 config.json (rope_parameters) into the form released checkpoints
    use (top-level rope_theta, rope_scaling or none). Returns the new dict."""
    path = Path(directory) / "config.json"
    hf = json.loads(path.read_text())
    rope = dict(hf.pop("rope_parameters"))
    hf["rope_theta"] = rope.pop("rope_theta")
    hf["rope_scaling"] = None if rope.get("rope_type", "default") == "default" else rope
    path.write_text(json.dumps(hf, indent=2))
    return hf


def save_tiny_checkpoint(directory: str | Path, config: ModelConfig, *, seed: int = 0) -> Path:
    """Save a random model of `config` as an HF directory (config.json + model.safetensors)
    written from our own parameters: no torch needed."""
    import numpy as np
    from safetensors.numpy import save_file

    from longspec_jax.checkpoint_hf import hf_parameter_slots
    from longspec_jax.target import random_target

    model = random_target(config, seed=seed, dtype="float32").model
    tensors = {
        name: np.ascontiguousarray(np.asarray(param[...]).T if transposed else np.asarray(param[...]))
        for name, param, transposed in hf_parameter_slots(model)
    }
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(config.to_hf_dict(), indent=2))
    return directory


def tiny_config(**overrides) -> ModelConfig:
    """A tiny Llama-shaped ModelConfig (GQA 4/2, head dim 16, 2 layers) for tests of our model only."""
    base = ModelConfig(
        model_type="llama",
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=512,
        eos_token_ids=(2,),
    )
    return dataclasses.replace(base, **overrides)
