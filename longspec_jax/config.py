"""Model configuration: a frozen dataclass read from an HF `config.json`.

Both forms found in the wild are read: released checkpoints put `rope_theta` / `rope_scaling`
at the top level, transformers 5 writes a `rope_parameters` dict instead.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from longspec_jax.errors import UserError

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling. kind: "default", "linear" or "llama3"."""

    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shapes and hyper-parameters of a Llama- or Qwen2-family decoder."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = RopeScaling()
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any]) -> ModelConfig:
        """The config of an HF config dict; a missing key or a value of the wrong type is a UserError."""
        try:
            return cls._from_hf_dict(hf)
        except UserError:
            raise
        except KeyError as e:
            raise UserError(f"the model config lacks {e.args[0]}: use the config.json saved with the weights") from None
        except (TypeError, ValueError, AttributeError) as e:
            raise UserError(
                f"the model config holds a value of the wrong type ({e}): use the config.json saved with the weights"
            ) from None

    @classmethod
    def _from_hf_dict(cls, hf: dict[str, Any]) -> ModelConfig:
        model_type = hf.get("model_type", "")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UserError(
                f"unsupported architecture model_type={model_type!r}; longspec-jax supports "
                f"{', '.join(SUPPORTED_MODEL_TYPES)} (Llama family and Qwen2/2.5)"
            )
        num_heads = int(hf["num_attention_heads"])
        hidden = int(hf["hidden_size"])
        theta, scaling = _read_rope(hf)
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))
        is_qwen2 = model_type == "qwen2"
        attention_bias = bool(hf.get("attention_bias", False))
        return cls(
            model_type=model_type,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
            head_dim=int(hf.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=is_qwen2 or attention_bias,
            o_bias=attention_bias and not is_qwen2,
            mlp_bias=bool(hf.get("mlp_bias", False)),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=tuple(int(e) for e in eos_ids),
        )

    @classmethod
    def from_json_file(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        if not path.is_file():
            raise UserError(f"no config.json at {path}: point --target at an HF checkpoint directory")
        return cls.from_hf_dict(read_json_object(path))

    def to_hf_dict(self) -> dict[str, Any]:
        """The config in the released-checkpoint form (top-level rope_theta / rope_scaling)."""
        out: dict[str, Any] = {
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.o_bias,
            "mlp_bias": self.mlp_bias,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids),
        }
        s = self.rope_scaling
        if s.kind == "linear":
            out["rope_scaling"] = {"rope_type": "linear", "factor": s.factor}
        elif s.kind == "llama3":
            out["rope_scaling"] = {
                "rope_type": "llama3",
                "factor": s.factor,
                "low_freq_factor": s.low_freq_factor,
                "high_freq_factor": s.high_freq_factor,
                "original_max_position_embeddings": s.original_max_position_embeddings,
            }
        return out


def read_json_object(path: Path) -> dict[str, Any]:
    """The JSON object in the file at `path`; a file that is not one is a UserError naming it."""
    try:
        value = json.loads(Path(path).read_bytes())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{path} is not valid JSON ({e}): restore the file from the checkpoint's source") from None
    if not isinstance(value, dict):
        raise UserError(
            f"{path} holds a JSON {type(value).__name__}, not an object: restore the file from the checkpoint's source"
        )
    return value


def _read_rope(hf: dict[str, Any]) -> tuple[float, RopeScaling]:
    params = hf.get("rope_parameters")
    if isinstance(params, dict):
        theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
        scaling = params
    else:
        theta = float(hf.get("rope_theta", 10000.0))
        scaling = hf.get("rope_scaling") or {}
    kind = scaling.get("rope_type", scaling.get("type", "default")) or "default"
    if kind == "default":
        return theta, RopeScaling()
    if kind == "linear":
        return theta, RopeScaling(kind="linear", factor=float(scaling["factor"]))
    if kind == "llama3":
        return theta, RopeScaling(
            kind="llama3",
            factor=float(scaling["factor"]),
            low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
            high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(scaling.get("original_max_position_embeddings", 8192)),
        )
    raise UserError(f"unsupported rope scaling type {kind!r}; supported: default, linear, llama3")
