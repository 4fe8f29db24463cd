"""The published targets' configs in one table, for the training configs, the benchmarks and the tests.

Each entry is what `ModelConfig.from_hf_dict` reads from the model's `config.json`; a checkpoint on
disk still brings its own config. The benchmarks time random weights in these shapes through
`timing_shape`.
"""

from __future__ import annotations

import dataclasses

from longspec_jax.config import ModelConfig, RopeScaling

MODEL_SHAPES: dict[str, ModelConfig] = {
    # Vicuna-7B-v1.5-16k: Llama-2-7B with linear RoPE x4 for a 16k context.
    "vicuna7b": ModelConfig(
        model_type="llama",
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=11008,
        num_layers=32,
        num_heads=32,
        num_kv_heads=32,
        head_dim=128,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        rope_scaling=RopeScaling(kind="linear", factor=4.0),
        max_position_embeddings=16384,
        bos_token_id=1,
        eos_token_ids=(2,),
    ),
    # Llama-3.1-8B-Instruct: GQA 32/8, llama3 RoPE scaling, 128k context.
    "llama31_8b": ModelConfig(
        model_type="llama",
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling=RopeScaling(
            kind="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
        ),
        max_position_embeddings=131072,
        bos_token_id=128000,
        eos_token_ids=(128001, 128008, 128009),
    ),
    # QwQ-32B: Qwen2 family, GQA 40/8, q/k/v bias, theta 1e6.
    "qwq32b": ModelConfig(
        model_type="qwen2",
        vocab_size=152064,
        hidden_size=5120,
        intermediate_size=27648,
        num_layers=64,
        num_heads=40,
        num_kv_heads=8,
        head_dim=128,
        rms_norm_eps=1e-5,
        rope_theta=1_000_000.0,
        max_position_embeddings=40960,
        qkv_bias=True,
        bos_token_id=151643,
        eos_token_ids=(151645,),
    ),
    # SmolLM2-135M-Instruct: the embedded demo target (GQA 9/3, tied embeddings, 8k context).
    "smollm2_135m": ModelConfig(
        model_type="llama",
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_ids=(2,),
    ),
}


def timing_shape(name: str, max_len: int) -> ModelConfig:
    """MODEL_SHAPES[name] for timing random weights at contexts up to max_len.

    RoPE scaling is dropped (a step costs the same whatever the frequencies, and the position limit
    may exceed the model's own window), and so are BOS / EOS: random weights would otherwise stop a
    timed decode whenever they happen to pick an EOS.
    """
    return dataclasses.replace(
        MODEL_SHAPES[name],
        rope_scaling=RopeScaling(),
        max_position_embeddings=max_len,
        bos_token_id=None,
        eos_token_ids=(),
    )
