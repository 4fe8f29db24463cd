"""Draft checkpoints: our export round trip, the reference's HF and training (.pth) layouts, and
the errors a user sees for a draft that does not fit the target."""

from __future__ import annotations

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from safetensors.numpy import save_file

from longspec_jax.draft import DraftBlock, DraftConfig
from longspec_jax.draft_io import init_draft, load_draft
from longspec_jax.errors import UserError
from longspec_jax.target import random_target
from tests.tiny_models import tiny_config

CFG = tiny_config()
H, F = CFG.hidden_size, CFG.intermediate_size
QD, KD = CFG.num_heads * CFG.head_dim, CFG.num_kv_heads * CFG.head_dim

# The reference's tensor names and HF shapes (docs/ALGORITHM.md 3), written out here independently of
# draft_io's own mapping; cross_attn.k_proj / v_proj exist in the reference but are unused.
REFERENCE_SHAPES = {
    "self_attn.q_proj.weight": (QD, H),
    "self_attn.q_proj.bias": (QD,),
    "self_attn.k_proj.weight": (KD, H),
    "self_attn.k_proj.bias": (KD,),
    "self_attn.v_proj.weight": (KD, H),
    "self_attn.v_proj.bias": (KD,),
    "self_attn.o_proj.weight": (H, QD),
    "cross_attn.q_proj.weight": (QD, H),
    "cross_attn.q_proj.bias": (QD,),
    "cross_attn.k_proj.weight": (KD, H),
    "cross_attn.k_proj.bias": (KD,),
    "cross_attn.v_proj.weight": (KD, H),
    "cross_attn.v_proj.bias": (KD,),
    "cross_attn.o_proj.weight": (H, QD),
    "mlp.gate_proj.weight": (F, H),
    "mlp.up_proj.weight": (F, H),
    "mlp.down_proj.weight": (H, F),
    "input_layernorm.weight": (H,),
    "post_self_attention_layernorm.weight": (H,),
    "post_cross_attention_layernorm.weight": (H,),
}


def _reference_tensors(seed=0):
    rng = np.random.default_rng(seed)
    return {name: rng.normal(size=shape).astype(np.float32) for name, shape in REFERENCE_SHAPES.items()}


def _direct_block(t, window=512):
    """The draft built by hand from reference tensors: HF linear weights are [out, in]."""
    block = DraftBlock(CFG, DraftConfig(window=window), rngs=nnx.Rngs(99))
    for mod_name in ("self_attn", "cross_attn"):
        mod = getattr(block, mod_name)
        projections = ("q_proj", "k_proj", "v_proj", "o_proj") if mod_name == "self_attn" else ("q_proj", "o_proj")
        for proj in projections:
            lin = getattr(mod, proj)
            lin.kernel[...] = jnp.asarray(t[f"{mod_name}.{proj}.weight"].T)
            if lin.bias is not None:
                lin.bias[...] = jnp.asarray(t[f"{mod_name}.{proj}.bias"])
    for proj in ("gate_proj", "up_proj", "down_proj"):
        getattr(block.mlp, proj).kernel[...] = jnp.asarray(t[f"mlp.{proj}.weight"].T)
    for norm in ("input_layernorm", "post_self_attention_layernorm", "post_cross_attention_layernorm"):
        getattr(block, norm).weight[...] = jnp.asarray(t[f"{norm}.weight"])
    return block


def _assert_same_block(a: DraftBlock, b: DraftBlock):
    sa, sb = nnx.state(a, nnx.Param), nnx.state(b, nnx.Param)
    assert jax.tree.structure(sa) == jax.tree.structure(sb)
    for x, y in zip(jax.tree.leaves(sa), jax.tree.leaves(sb)):
        np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))
    assert a.window == b.window


@pytest.fixture(scope="module")
def target():
    return random_target(CFG, seed=0)


def test_export_round_trip_keeps_parameters_and_window(tmp_path, target):
    draft = init_draft(target, seed=3, config=DraftConfig(window=16))
    draft.save(tmp_path / "d")
    assert json.loads((tmp_path / "d" / "config.json").read_text())["longspec_jax_draft"]["window"] == 16
    loaded = load_draft(tmp_path / "d", target)
    _assert_same_block(loaded.block, draft.block)
    assert loaded.block.dtype == jnp.float32


def test_bfloat16_cast_saves_and_loads_as_float32(tmp_path, target):
    draft = init_draft(target, seed=4).cast(jnp.bfloat16)
    assert draft.block.self_attn.q_proj.kernel.dtype == jnp.bfloat16
    loaded = load_draft(draft.save(tmp_path / "bf16"), target)
    _assert_same_block(loaded.block, draft.block)


@pytest.mark.parametrize("prefix", ["", "model.layers.0."])
def test_reference_hf_directory_imports(tmp_path, target, prefix):
    tensors = _reference_tensors(seed=1)
    save_file({prefix + k: v for k, v in tensors.items()}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(CFG.to_hf_dict()))
    _assert_same_block(load_draft(tmp_path, target).block, _direct_block(tensors))


def test_reference_training_pth_imports(tmp_path, target):
    tensors = _reference_tensors(seed=2)
    state = {"draft_model." + k: torch.from_numpy(v) for k, v in tensors.items()}
    # A whole-model state dict also holds target layers, which have self_attn.* names too.
    state["target_model.model.layers.0.self_attn.q_proj.weight"] = torch.zeros(QD, H)
    state["draft_model.self_attn.rotary_emb.inv_freq"] = torch.ones(CFG.head_dim // 2)
    torch.save(state, tmp_path / "draft.pth")
    _assert_same_block(load_draft(tmp_path / "draft.pth", target).block, _direct_block(tensors))


def test_reference_hf_directory_with_pytorch_bin_imports(tmp_path, target):
    tensors = _reference_tensors(seed=5)
    torch.save({k: torch.from_numpy(v) for k, v in tensors.items()}, tmp_path / "pytorch_model.bin")
    (tmp_path / "config.json").write_text(json.dumps(CFG.to_hf_dict()))
    _assert_same_block(load_draft(tmp_path, target).block, _direct_block(tensors))


def test_wrong_sized_draft_names_tensor_and_shapes(tmp_path):
    init_draft(random_target(CFG), seed=0).save(tmp_path / "d")
    other = random_target(tiny_config(intermediate_size=80))
    with pytest.raises(UserError, match=r"mlp\.down_proj\.weight has shape \(64, 96\) .* needs \(64, 80\)"):
        load_draft(tmp_path / "d", other)


def test_missing_and_foreign_tensors_fail_clearly(tmp_path, target):
    tensors = _reference_tensors()
    del tensors["mlp.up_proj.weight"]
    save_file(tensors, str(tmp_path / "partial.safetensors"))
    with pytest.raises(UserError, match=r"no tensor mlp\.up_proj\.weight"):
        load_draft(tmp_path / "partial.safetensors", target)
    extra = {**_reference_tensors(), "mlp.gate_proj.bias": np.zeros(F, np.float32)}
    save_file(extra, str(tmp_path / "extra.safetensors"))
    with pytest.raises(UserError, match=r"tensor mlp\.gate_proj\.bias which the LongSpec draft block does not have"):
        load_draft(tmp_path / "extra.safetensors", target)
    save_file({"model.norm.weight": np.ones(H, np.float32)}, str(tmp_path / "target.safetensors"))
    with pytest.raises(UserError, match="no LongSpec draft block"):
        load_draft(tmp_path / "target.safetensors", target)
    with pytest.raises(UserError, match="does not exist"):
        load_draft(tmp_path / "nowhere", target)


def test_pth_without_torch_names_the_install(tmp_path, target, monkeypatch):
    torch.save({"draft_model." + k: torch.from_numpy(v) for k, v in _reference_tensors().items()}, tmp_path / "d.pth")
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch now raises ImportError
    with pytest.raises(UserError, match="pip install torch"):
        load_draft(tmp_path / "d.pth", target)


def _export(tmp_path, target):
    return init_draft(target, seed=0, config=DraftConfig(window=16)).save(tmp_path / "d")


def _draft_error(path, target) -> str:
    with pytest.raises(UserError) as info:
        load_draft(path, target)
    assert "\n" not in str(info.value)
    return str(info.value)


def test_draft_config_that_is_not_json(tmp_path, target):
    directory = _export(tmp_path, target)
    (directory / "config.json").write_text('{"longspec_jax_draft": {"window": 16}')
    assert "config.json is not valid JSON" in _draft_error(directory, target)


@pytest.mark.parametrize("keep", [0, 7, 1000], ids=["empty", "seven-bytes", "first-kilobyte"])
def test_truncated_draft_weights(tmp_path, target, keep):
    directory = _export(tmp_path, target)
    weights = directory / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:keep])
    assert "model.safetensors is not a readable safetensors file" in _draft_error(directory, target)
    single = tmp_path / "single.safetensors"
    single.write_bytes(b"\x07" * keep)
    assert "single.safetensors is not a readable safetensors file" in _draft_error(single, target)


def test_garbage_pth(tmp_path, target):
    path = tmp_path / "draft.pth"
    path.write_bytes(np.random.default_rng(0).bytes(4096))
    assert "not a readable PyTorch state dict" in _draft_error(path, target)


@pytest.mark.parametrize(
    "entry",
    [
        {"window": 0},
        {"window": -3},
        {"window": 2.5},
        {"window": 16.0},
        {"window": "512"},
        {"window": True},
        {"window": None},
        {"window": 2**40},
        {"window": 16, "windw": 16},
        [16],
    ],
    ids=["zero", "negative", "fraction", "float", "string", "bool", "null", "absurd", "unknown-key", "a-list"],
)
def test_impossible_draft_config_is_refused(tmp_path, target, entry):
    directory = _export(tmp_path, target)
    config = json.loads((directory / "config.json").read_text())
    config["longspec_jax_draft"] = entry
    (directory / "config.json").write_text(json.dumps(config))
    message = _draft_error(directory, target)
    assert "config.json" in message and "restore the config.json saved with the draft" in message


@pytest.mark.parametrize("window", [1, 512, 1 << 20])
def test_draft_windows_in_range_load(tmp_path, target, window):
    directory = _export(tmp_path, target)
    config = json.loads((directory / "config.json").read_text())
    config["longspec_jax_draft"]["window"] = window
    (directory / "config.json").write_text(json.dumps(config))
    assert load_draft(directory, target).config.window == window
