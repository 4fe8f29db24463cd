"""GGUF checkpoints (llama.cpp's format) -> an HF config dict and float32 tensors by HF name.

The output is exactly what an HF safetensors checkpoint of the same model holds (names, `[out, in]`
orientation), so `checkpoint_hf.model_from_hf_tensors` builds the model from either. Two things
differ in a GGUF and are undone here:
- quantised blocks (Q4_1, Q8_0, F16, ...) are dequantised with the `gguf` package;
- llama.cpp's converter reorders the rows of every Llama Q/K head from HF's rotate-half layout
  (first half of the head, then second half) to interleaved pairs. Qwen2 GGUFs keep HF's order.
RoPE scaling comes back as HF's `rope_scaling`: linear from the metadata, llama3 (Llama 3.1) from the
`rope_freqs` tensor llama.cpp stores instead.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import numpy as np

from longspec_jax.config import ModelConfig
from longspec_jax.errors import UserError
from longspec_jax.gguf_cache import cached_gguf_tensors, converter_fingerprint
from longspec_jax.rope import inverse_frequencies

SUPPORTED_ARCHITECTURES = ("llama", "qwen2")

_TOP_LEVEL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Llama 3.1-style RoPE scaling is stored as per-frequency divisors, not as metadata.
_ROPE_FREQS = "rope_freqs.weight"


def read_gguf(path: str | Path) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """(HF config dict, {HF tensor name: float32 array in HF orientation}) of a GGUF file.

    Converted once per file: later calls read the result from the on-disk cache (`gguf_cache`)."""
    gguf = _gguf_package()
    path = Path(path)
    if not path.is_file():
        raise UserError(f"GGUF file {path} does not exist: pass the path of a .gguf file")
    fingerprint = converter_fingerprint(__file__, "gguf")
    return cached_gguf_tensors(path, lambda: _convert_gguf(gguf, path), fingerprint)


def _convert_gguf(gguf, path: Path) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, OSError, IndexError, KeyError, struct.error, UnicodeDecodeError) as e:
        # The reader parses the header with numpy views of the file (tensor data included): a truncated or
        # damaged file fails wherever the parse runs out of bytes, as any of these.
        raise UserError(
            f"{path} is not a readable GGUF file ({type(e).__name__}: {e}): it is truncated or damaged; "
            "download or convert it again"
        ) from None
    arch = _metadata(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UserError(
            f"unsupported GGUF architecture {arch!r} in {path}; longspec-jax reads "
            f"{', '.join(SUPPORTED_ARCHITECTURES)} GGUFs (or pass an HF checkpoint directory)"
        )
    raw = {t.name: t for t in reader.tensors}
    config = _hf_config(reader, arch, raw)
    tensors: dict[str, np.ndarray] = {}
    for name, tensor in raw.items():
        if name == _ROPE_FREQS:
            continue
        hf_name = _hf_name(name, path)
        try:
            values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        except NotImplementedError as e:
            raise UserError(
                f"{path}: tensor {name} uses {tensor.tensor_type.name}, which the installed gguf package "
                f"cannot dequantise; upgrade it (pip install -U gguf) or use another quantisation"
            ) from e
        # Copy: the reader's arrays are views of a memory-mapped file.
        values = np.array(values, dtype=np.float32).reshape(tuple(reversed(tensor.shape.tolist())))
        if arch == "llama" and name.split(".")[-2] in ("attn_q", "attn_k"):
            heads = config["num_attention_heads"] if ".attn_q." in name else config["num_key_value_heads"]
            values = unpermute_rope_rows(values, heads)
        tensors[hf_name] = values
    return config, tensors


def unpermute_rope_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Rows of a llama.cpp Q/K weight (or bias) `[heads * D, ...]` back into HF's rotate-half order.

    llama.cpp stores row `2 * j + half` of a head where HF has row `half * D/2 + j`."""
    per_head = w.shape[0] // num_heads
    pairs = w.reshape(num_heads, per_head // 2, 2, *w.shape[1:])
    return np.ascontiguousarray(pairs.swapaxes(1, 2).reshape(w.shape))


def _hf_name(gguf_name: str, path: Path) -> str:
    parts = gguf_name.split(".")
    if len(parts) == 2 and parts[0] in _TOP_LEVEL_NAMES:
        return f"{_TOP_LEVEL_NAMES[parts[0]]}.{parts[1]}"
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    raise UserError(
        f"{path} holds tensor {gguf_name!r}, which a plain Llama/Qwen2 decoder does not have: "
        "this model variant is not supported; pass an HF checkpoint directory instead"
    )


def _gguf_package():
    try:
        import gguf
    except ModuleNotFoundError as e:
        raise UserError("reading .gguf files needs the gguf package: pip install gguf") from e
    return gguf


def _metadata(reader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _float32_value(x: float) -> float:
    """A float32 metadata value as the decimal it was written from (9.999999747e-06 -> 1e-05)."""
    return float(str(np.float32(x)))


def _hf_config(reader, arch: str, raw: dict) -> dict[str, Any]:
    def meta(key: str, default: Any = None) -> Any:
        value = _metadata(reader, f"{arch}.{key}", default)
        if value is None:
            raise UserError(f"the GGUF lacks {arch}.{key}: it is incomplete; re-convert it with llama.cpp")
        return value

    if "token_embd.weight" not in raw:
        raise UserError("the GGUF has no token_embd.weight: it is incomplete; re-convert it with llama.cpp")
    hidden = int(meta("embedding_length"))
    heads = int(meta("attention.head_count"))
    head_dim = int(meta("attention.key_length", hidden // heads))
    theta = _float32_value(meta("rope.freq_base", 10000.0))
    layer0 = {name.split(".", 2)[2] for name in raw if name.startswith("blk.0.")}
    # Chat models end a turn with an end-of-turn token that llama.cpp records apart from EOS.
    stop_ids = [_metadata(reader, f"tokenizer.ggml.{kind}_token_id") for kind in ("eos", "eot", "eom")]
    stop_ids = list(dict.fromkeys(i for i in stop_ids if i is not None))
    config: dict[str, Any] = {
        "model_type": arch,
        # The embedding's row count, not tokenizer metadata: the weights must fit the config.
        "vocab_size": int(raw["token_embd.weight"].shape[1]),
        "hidden_size": hidden,
        "intermediate_size": int(meta("feed_forward_length")),
        "num_hidden_layers": int(meta("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": _float32_value(meta("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": theta,
        "max_position_embeddings": int(meta("context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in raw,
        "mlp_bias": "ffn_up.bias" in layer0,
        "bos_token_id": _metadata(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": stop_ids[0] if len(stop_ids) == 1 else (stop_ids or None),
    }
    if arch == "llama":
        config["attention_bias"] = "attn_q.bias" in layer0
    scaling = _rope_scaling(reader, arch, raw, head_dim, theta)
    if scaling is not None:
        config["rope_scaling"] = scaling
    return config


def _rope_scaling(reader, arch: str, raw: dict, head_dim: int, theta: float) -> dict[str, Any] | None:
    kind = _metadata(reader, f"{arch}.rope.scaling.type", "none")
    original = _metadata(reader, f"{arch}.rope.scaling.original_context_length")
    if _ROPE_FREQS in raw:
        divisors = _gguf_package().quants.dequantize(raw[_ROPE_FREQS].data, raw[_ROPE_FREQS].tensor_type)
        return _llama3_scaling(np.asarray(divisors, np.float64).ravel(), head_dim, theta, original or 8192)
    if kind == "none":
        return None
    if kind == "linear":
        factor = _metadata(reader, f"{arch}.rope.scaling.factor")
        return {"rope_type": "linear", "factor": _float32_value(factor)}
    raise UserError(f"unsupported RoPE scaling {kind!r} in the GGUF; supported: none, linear, llama3")


def _llama3_scaling(divisors: np.ndarray, head_dim: int, theta: float, original: int) -> dict[str, Any]:
    """Recover HF's llama3 rope_scaling from llama.cpp's per-frequency divisors.

    Divisors are 1 (fast frequencies), `factor` (slow ones) and, in between, 1 / ((1 - s) / factor + s)
    with s linear in the frequency: s = (original * inv_freq / 2pi - low) / (high - low). Fitting that
    line gives low and high (for the given `original`; scaling all three together changes nothing).
    The result is checked by recomputing the divisors the way `rope.inverse_frequencies` does."""
    factor = float(divisors.max())
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    mid = (divisors > 1 + 1e-4) & (divisors < factor * (1 - 1e-4))
    low, high = 1.0, 4.0  # Llama 3.1's values, kept when too few mid frequencies pin the line down
    if mid.sum() >= 2 and factor > 1:
        s = (1 / divisors[mid] - 1 / factor) / (1 - 1 / factor)
        slope, intercept = np.polyfit(original * inv_freq[mid] / (2 * np.pi), s, 1)
        low = float(-intercept / slope)
        high = float(low + 1 / slope)
    scaling = {
        "rope_type": "llama3",
        "factor": _float32_value(factor),
        "low_freq_factor": round(low, 4),
        "high_freq_factor": round(high, 4),
        "original_max_position_embeddings": int(original),
    }
    probe = {
        "model_type": "llama",
        "vocab_size": 1,
        "hidden_size": head_dim,
        "intermediate_size": 1,
        "num_hidden_layers": 1,
        "num_attention_heads": 1,
        "head_dim": head_dim,
        "rope_theta": theta,
        "rope_scaling": scaling,
    }
    ours = inverse_frequencies(ModelConfig.from_hf_dict(probe)).astype(np.float64)
    if not np.allclose(ours, inv_freq / divisors, rtol=1e-4, atol=0):
        raise UserError(
            "the GGUF's rope_freqs tensor matches no llama3 RoPE scaling: pass the HF checkpoint directory instead"
        )
    return scaling
