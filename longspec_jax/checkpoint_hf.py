"""HF checkpoints: safetensors directories (single file or sharded index) -> our Transformer.

`model_from_hf_tensors` is the one place that maps HF parameter names onto the model; the GGUF
loader feeds it too. HF linear weights are `[out, in]`, ours `[in, out]`, hence the transposes.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import SafetensorError, safe_open

from longspec_jax.config import ModelConfig, read_json_object
from longspec_jax.errors import UserError
from longspec_jax.model import Linear, Transformer

SINGLE_FILE = "model.safetensors"
SHARD_INDEX = "model.safetensors.index.json"


def safetensors_files(directory: Path) -> list[Path]:
    """The weight files of an HF directory, from the shard index when there is one."""
    index = directory / SHARD_INDEX
    if index.is_file():
        weight_map = read_json_object(index).get("weight_map") or {}
        files = [directory / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise UserError(f"{index} lists shard {missing[0]} which is not in {directory}: copy the whole checkpoint")
        return files
    if (directory / SINGLE_FILE).is_file():
        return [directory / SINGLE_FILE]
    raise UserError(
        f"no weights in {directory}: expected {SINGLE_FILE} or {SHARD_INDEX} "
        "(convert .bin/.pth checkpoints to safetensors first)"
    )


def read_hf_tensors(directory: str | Path) -> dict[str, np.ndarray]:
    """All tensors of an HF safetensors directory by name, as host numpy arrays (bfloat16 ones as
    ml_dtypes.bfloat16), so only the model's own arrays ever occupy the accelerator."""
    tensors: dict[str, np.ndarray] = {}
    for file in safetensors_files(Path(directory)):
        tensors.update(read_safetensors_file(file))
    return tensors


def read_safetensors_file(file: str | Path) -> dict[str, np.ndarray]:
    """All tensors of one .safetensors file as host numpy arrays (bfloat16 as ml_dtypes.bfloat16);
    a damaged file (truncated, not safetensors) is a UserError naming it."""
    try:
        with safe_open(file, framework="numpy") as f:
            bf16 = {name for name in f.keys() if f.get_slice(name).get_dtype() == "BF16"}
            tensors = {name: f.get_tensor(name) for name in f.keys() if name not in bf16}
        if bf16:
            # safetensors' numpy reader has no bfloat16; its JAX reader does, placed on the host.
            with jax.default_device(_host_device()), safe_open(file, framework="flax") as f:
                tensors.update({name: np.asarray(f.get_tensor(name)) for name in bf16})
    except SafetensorError as e:
        raise UserError(
            f"{file} is not a readable safetensors file ({e}): it is damaged or truncated; download or copy it again"
        ) from None
    return tensors


def _host_device():
    try:
        return jax.devices("cpu")[0]
    except RuntimeError:  # JAX_PLATFORMS without cpu: the default device it is
        return None


def hf_parameter_slots(model: Transformer) -> Iterator[tuple[str, nnx.Variable, bool]]:
    """(HF tensor name, our parameter, whether HF stores it transposed) for every parameter."""

    def linear(prefix: str, lin: Linear):
        yield f"{prefix}.weight", lin.kernel, True
        if lin.bias is not None:
            yield f"{prefix}.bias", lin.bias, False

    yield "model.embed_tokens.weight", model.embed, False
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}"
        yield f"{p}.input_layernorm.weight", layer.input_layernorm.weight, False
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            yield from linear(f"{p}.self_attn.{name}", getattr(layer.self_attn, name))
        yield f"{p}.post_attention_layernorm.weight", layer.post_attention_layernorm.weight, False
        for name in ("gate_proj", "up_proj", "down_proj"):
            yield from linear(f"{p}.mlp.{name}", getattr(layer.mlp, name))
    yield "model.norm.weight", model.norm.weight, False
    if model.lm_head is not None:
        yield "lm_head.weight", model.lm_head, False


def model_from_hf_tensors(config: ModelConfig, tensors: Mapping[str, np.ndarray], dtype) -> Transformer:
    """Build the Transformer from HF-named tensors (numpy arrays; JAX arrays work too), cast to `dtype`.

    Every expected tensor must be there with the shape the config implies; extra tensors
    (a tied checkpoint's lm_head.weight, old rotary buffers) are ignored."""
    dtype = jnp.dtype(dtype)
    model = nnx.eval_shape(lambda: Transformer(config, dtype=dtype, rngs=nnx.Rngs(0)))
    for name, param, transposed in hf_parameter_slots(model):
        ours = tuple(param.shape)
        expected = ours[::-1] if transposed else ours
        if name not in tensors:
            raise UserError(
                f"checkpoint has no tensor {name} (shape {expected}): the weights do not match "
                f"config.json ({config.model_type}, {config.num_layers} layers); use the config saved with them"
            )
        tensor = tensors[name]
        if tuple(tensor.shape) != expected:
            raise UserError(
                f"tensor {name} has shape {tuple(tensor.shape)} but config.json implies {expected}: "
                "the weights do not match config.json; use the config saved with them"
            )
        # Onto the device in the stored dtype, then cast and transpose there: host-side casts
        # to bfloat16 are slow at 7B size.
        array = jnp.asarray(tensor).astype(dtype)
        param.set_value(array.T if transposed else array)
    return model


def load_hf_model(directory: str | Path, dtype) -> tuple[ModelConfig, Transformer]:
    """config.json + safetensors of an HF directory -> (config, model)."""
    directory = Path(directory)
    config = ModelConfig.from_json_file(directory / "config.json")
    return config, model_from_hf_tensors(config, read_hf_tensors(directory), dtype)
