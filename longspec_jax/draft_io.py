"""Creating, saving and loading drafts: `Draft`, `init_draft`, `load_draft`.

`load_draft(path, target)` reads
  (i)   our export: a directory with model.safetensors + config.json (written by `Draft.save`);
  (ii)  the reference's HF draft directories (`sail/longspec-<target>`): safetensors (single or
        sharded) or pytorch_model.bin, or a single .safetensors file;
  (iii) the reference's training state dicts (.pth / .pt / .bin, torch needed), where the block's
        tensors carry a `draft_model.` prefix.
All three use the reference's tensor names (docs/ALGORITHM.md 3), HF layout ([out, in] linear weights). Any
prefix before them (`draft_model.`, `model.layers.0.`, ...) is found from the one tensor only the
draft has, post_cross_attention_layernorm.weight. cross_attn.k_proj / v_proj are unused by the
model (it reads the target's K/V) and are skipped. Every shape is checked against the target.
"""

from __future__ import annotations

import dataclasses
import json
import pickle
from collections.abc import Iterator, Mapping
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from longspec_jax.candidate_vocabulary import candidate_tokens_key, check_candidate_tokens
from longspec_jax.checkpoint_hf import read_hf_tensors, read_safetensors_file
from longspec_jax.config import ModelConfig, read_json_object
from longspec_jax.draft import DraftBlock, DraftConfig
from longspec_jax.draft_head import DraftHead, check_head_format, draft_head
from longspec_jax.errors import UserError
from longspec_jax.int8_rows import block_reads_int8, check_block_format

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
EXPORT_KEY = "longspec_jax_draft"
TORCH_SUFFIXES = (".pth", ".pt", ".bin")
MARKER_TENSOR = "post_cross_attention_layernorm.weight"
CANDIDATES_TENSOR = "candidate_tokens"  # our export's: the draft's candidate vocabulary
BLOCK_PARTS = ("self_attn.", "cross_attn.", "mlp.", "input_layernorm.", "post_self_attention_layernorm.", MARKER_TENSOR)
UNUSED_PARTS = ("cross_attn.k_proj.", "cross_attn.v_proj.")
ROPE_BUFFER = "rotary_emb.inv_freq"  # older transformers saved it in state dicts; ours is recomputed
# The ring buffer holds `window` positions per sequence; beyond a million a window is a typo, not a choice.
MAX_WINDOW = 1 << 20


@dataclasses.dataclass
class Draft:
    """A draft ready to run: `.block` (DraftBlock, float32 unless cast), `.config` (DraftConfig),
    `.target_config` (the ModelConfig it was built for), `.candidate_tokens` (int32[C] ascending:
    the tokens it proposes from, candidate_vocabulary.py; None: the whole vocabulary), `.head_format`
    (how it reads the LM head, draft_head.HEAD_FORMATS: "auto" is int8 for a large head) and
    `.block_format` (how its inference block holds its matrices, int8_rows.BLOCK_FORMATS: "auto" is
    int8 for a large block)."""

    block: DraftBlock
    candidate_tokens: np.ndarray | None = None
    head_format: str = "auto"
    block_format: str = "auto"
    # What inference_block and head_under built, by key, each with the identities of its sources.
    _built: dict = dataclasses.field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def config(self) -> DraftConfig:
        return DraftConfig(window=self.block.window)

    @property
    def target_config(self) -> ModelConfig:
        return self.block.config

    def inference_block(self, small_rows: tuple[int, ...] = ()) -> DraftBlock:
        """The block in its inference layout (`DraftBlock.inference_layout`; its matrices int8 where
        `block_format` says so), built once per small_rows and shared by every proposer made from
        this draft (mode auto makes one per plan; a 7B target's draft block is ~0.5 GB a copy);
        rebuilt when the block's arrays were replaced."""
        int8 = self.block_int8
        arrays = tuple(id(x) for x in jax.tree.leaves(nnx.state(self.block)))
        return self._once(("block", small_rows, int8), arrays, lambda: self.block.inference_layout(small_rows, int8))

    @property
    def block_int8(self) -> bool:
        """Whether the inference block holds its matrices as int8 (`block_format`, "auto" by the
        bytes of the block as loaded)."""
        leaves = jax.tree.leaves(nnx.state(self.block))
        return block_reads_int8(self.block_format, sum(x.size * x.dtype.itemsize for x in leaves))

    def head_under(self, target_model) -> DraftHead | None:
        """The head this draft ranks its candidates under in target_model (`draft_head.draft_head`:
        its candidate tokens' rows, int8 where `head_format` says so; None: the target's head as it
        is), built once per head and shared like `inference_block`'s block (32k rows of a 4,096-wide
        head are 0.27 GB; Llama-3's int8 head 0.5 GB)."""
        head = target_model.embed if target_model.lm_head is None else target_model.lm_head
        sources = (id(head[...]), id(self.candidate_tokens), self.head_format)
        return self._once(("head",), sources, lambda: draft_head(target_model, self.candidate_tokens, self.head_format))

    def _once(self, key, sources: tuple, build):
        """build(), kept under key while `sources` (identities of what it was built from) hold."""
        if key not in self._built or self._built[key][0] != sources:
            self._built[key] = (sources, build())
        return self._built[key][1]

    def cast(self, dtype) -> Draft:
        """A copy with every parameter in `dtype` (bfloat16 for inference)."""
        graphdef, state = nnx.split(self.block)
        block = nnx.merge(graphdef, jax.tree.map(lambda x: x.astype(dtype), state))
        return Draft(block, self.candidate_tokens, self.head_format, self.block_format)

    def with_candidate_tokens(self, ids) -> Draft:
        """The same draft proposing from token ids (None: from the whole vocabulary)."""
        if ids is not None:
            ids = check_candidate_tokens(ids, self.target_config.vocab_size, "candidate tokens")
        return dataclasses.replace(self, candidate_tokens=ids)

    def proposal_key(self) -> str:
        """What this draft proposes from, for the keys of what its rounds cost and keep: its
        candidate tokens (`candidate_tokens_key`) and head and block formats other than "auto"."""
        key = candidate_tokens_key(self.candidate_tokens)
        if self.head_format != "auto":
            key = f"{key}/{self.head_format}"
        return key if self.block_format == "auto" else f"{key}/block-{self.block_format}"

    def with_head_format(self, head_format: str) -> Draft:
        """The same draft reading the LM head as `head_format` says (draft_head.HEAD_FORMATS); this
        draft itself where that is its format already (what it built stays shared)."""
        if check_head_format(head_format) == self.head_format:
            return self
        return dataclasses.replace(self, head_format=head_format)

    def with_block_format(self, block_format: str) -> Draft:
        """The same draft holding its inference block's matrices as `block_format` says
        (int8_rows.BLOCK_FORMATS); this draft itself where that is its format already."""
        if check_block_format(block_format) == self.block_format:
            return self
        return dataclasses.replace(self, block_format=block_format)

    def save(self, path: str | Path) -> Path:
        """Write our export: `path/model.safetensors` (reference names, parameter dtype; the
        candidate tokens, if any, as `candidate_tokens`) and `path/config.json` (the window and
        the target config it fits)."""
        from safetensors.flax import save_file

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        tensors = {
            name: jnp.asarray(param[...].T if transposed else param[...])
            for name, param, transposed in draft_parameter_slots(self.block)
        }
        if self.candidate_tokens is not None:
            tensors[CANDIDATES_TENSOR] = jnp.asarray(self.candidate_tokens, jnp.int32)
        save_file(tensors, str(path / WEIGHTS_FILE))
        config = {EXPORT_KEY: dataclasses.asdict(self.config), "target": self.target_config.to_hf_dict()}
        (path / CONFIG_FILE).write_text(json.dumps(config, indent=2))
        return path


def draft_parameter_slots(block: DraftBlock) -> Iterator[tuple[str, nnx.Variable, bool]]:
    """(reference tensor name, our parameter, whether the reference stores it transposed)."""
    for path, param in nnx.to_flat_state(nnx.state(block, nnx.Param)):
        *module, leaf = (str(p) for p in path)
        if leaf == "kernel":
            yield ".".join([*module, "weight"]), param, True
        else:
            yield ".".join([*module, leaf]), param, False


def init_draft(target, seed: int = 0, *, config: DraftConfig = DraftConfig()) -> Draft:
    """A randomly initialised float32 draft for `target` (a Target: sizes and RoPE from target.config)."""
    return Draft(DraftBlock(target.config, config, rngs=nnx.Rngs(seed)))


def inference_draft(target, path: str | Path | None = None, *, sampling: bool = False) -> Draft | None:
    """The draft to decode `target` with, in the target's dtype: the one at `path`, else the one
    this project ships for the target (`target.shipped_draft`, which `load_target` finds by the
    target file's content, not its path; with `sampling`, `target.shipped_sampling_draft` where
    there is one), else None."""
    if path is None:
        shipped_for_sampling = target.shipped_sampling_draft if sampling else None
        path = shipped_for_sampling or target.shipped_draft
    if path is None:
        return None
    draft = load_draft(path, target)
    return draft if jax.tree.leaves(draft.block)[0].dtype == target.dtype else draft.cast(target.dtype)


def sampling_draft_for(target, draft: Draft | None = None, sampling_draft: Draft | None = None) -> Draft | None:
    """The draft sampled requests decode with: `sampling_draft` where given, else `draft` where
    given, else the one shipped for the target to sample with (`inference_draft(sampling=True)`)."""
    if sampling_draft is not None:
        return sampling_draft
    return draft if draft is not None else inference_draft(target, sampling=True)


def load_draft(path: str | Path, target) -> Draft:
    """A float32 draft for `target` from our export, a reference HF draft directory or file, or a
    reference training .pth state dict (see the module docstring)."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"draft path {path} does not exist: pass a draft directory, .safetensors or .pth file")
    tensors, config = _read_checkpoint(path)
    return draft_from_tensors(tensors, target.config, config, source=str(path))


def draft_from_tensors(
    tensors: Mapping[str, object],
    target_config: ModelConfig,
    config: DraftConfig = DraftConfig(),
    *,
    source: str = "checkpoint",
) -> Draft:
    """Build the draft from tensors named as the reference (numpy, JAX or torch arrays), with or
    without a common prefix. Shapes must fit target_config."""
    prefix = _block_prefix(tensors, source)
    block = nnx.eval_shape(lambda: DraftBlock(target_config, config, rngs=nnx.Rngs(0)))
    expected_names = set()
    for name, param, transposed in draft_parameter_slots(block):
        full = prefix + name
        expected_names.add(full)
        expected = tuple(param.shape)[::-1] if transposed else tuple(param.shape)
        if full not in tensors:
            raise UserError(f"{source} has no tensor {full} (shape {expected}): it is not a complete LongSpec draft")
        array = _float32_numpy(tensors[full])
        if array.shape != expected:
            c = target_config
            raise UserError(
                f"draft tensor {full} has shape {array.shape} but the target ({c.model_type}, hidden {c.hidden_size}, "
                f"{c.num_heads}/{c.num_kv_heads} heads of {c.head_dim}, FFN {c.intermediate_size}) needs {expected}: "
                "this draft was made for a different target; load the draft that matches the target"
            )
        param.set_value(jnp.asarray(array.T if transposed else array))
    unexpected = [
        name
        for name in tensors
        if name.startswith(prefix)
        and name not in expected_names
        and ROPE_BUFFER not in name
        and name[len(prefix) :].startswith(BLOCK_PARTS)
        and not name[len(prefix) :].startswith(UNUSED_PARTS)
    ]
    if unexpected:
        raise UserError(
            f"{source} has tensor {unexpected[0]} which the LongSpec draft block does not have: not a LongSpec draft"
        )
    candidates = tensors.get(CANDIDATES_TENSOR)
    if candidates is not None:
        candidates = check_candidate_tokens(np.asarray(candidates), target_config.vocab_size, source)
    return Draft(block, candidates)


def _block_prefix(tensors: Mapping[str, object], source: str) -> str:
    prefixes = sorted({name[: -len(MARKER_TENSOR)] for name in tensors if name.endswith(MARKER_TENSOR)})
    prefixes = [p for p in prefixes if p == "" or p.endswith(".")]
    if not prefixes:
        raise UserError(
            f"{source} holds no LongSpec draft block (no tensor named {MARKER_TENSOR}): is it a draft checkpoint?"
        )
    if len(prefixes) > 1:
        raise UserError(
            f"{source} holds several draft blocks (prefixes {', '.join(map(repr, prefixes))}): "
            "pass a single-draft checkpoint"
        )
    return prefixes[0]


def _float32_numpy(tensor) -> np.ndarray:
    if hasattr(tensor, "detach"):  # a torch tensor; numpy has no bfloat16, so convert in torch
        return tensor.detach().float().cpu().numpy()
    return np.asarray(jnp.asarray(tensor, jnp.float32) if not isinstance(tensor, np.ndarray) else tensor, np.float32)


def _read_checkpoint(path: Path) -> tuple[Mapping[str, object], DraftConfig]:
    """(tensors by name, draft config: our export's, else the default)."""
    if path.is_file():
        if path.suffix == ".safetensors":
            return read_safetensors_file(path), DraftConfig()
        if path.suffix in TORCH_SUFFIXES:
            return _read_torch(path), DraftConfig()
        raise UserError(
            f"draft file {path} is neither .safetensors nor {'/'.join(TORCH_SUFFIXES)}: pass a draft checkpoint"
        )
    config_path = path / CONFIG_FILE
    config = read_json_object(config_path) if config_path.is_file() else {}
    if EXPORT_KEY in config:
        if not (path / WEIGHTS_FILE).is_file():
            raise UserError(f"draft export {path} has {CONFIG_FILE} but no {WEIGHTS_FILE}: copy the whole directory")
        return read_safetensors_file(path / WEIGHTS_FILE), draft_config_from_dict(config[EXPORT_KEY], config_path)
    torch_files = sorted(f for f in path.iterdir() if f.suffix in TORCH_SUFFIXES)
    if not any(path.glob("*.safetensors")) and torch_files:
        return _read_torch(torch_files[0]), DraftConfig()
    return read_hf_tensors(path), DraftConfig()


def draft_config_from_dict(values, source: Path | str) -> DraftConfig:
    """A DraftConfig from our export's `longspec_jax_draft` entry, every field checked."""
    fields = {f.name for f in dataclasses.fields(DraftConfig)}
    if not isinstance(values, dict) or not set(values) <= fields:
        raise UserError(
            f"{source}: {EXPORT_KEY} must be an object with the fields {', '.join(sorted(fields))}, got {values!r}: "
            "restore the config.json saved with the draft"
        )
    window = values.get("window", DraftConfig.window)
    if isinstance(window, bool) or not isinstance(window, int) or not 1 <= window <= MAX_WINDOW:
        raise UserError(
            f"{source}: the draft window must be an integer from 1 to {MAX_WINDOW}, got {window!r}: "
            "restore the config.json saved with the draft (its training window, 512 by default)"
        )
    return DraftConfig(window=window)


def _read_torch(path: Path) -> Mapping[str, object]:
    try:
        import torch
    except ImportError:
        raise UserError(f"reading {path} (a PyTorch state dict) needs torch: pip install torch") from None
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except (RuntimeError, EOFError, OSError, pickle.UnpicklingError) as e:
        # torch's own messages run over many lines; the type is enough to tell what went wrong.
        raise UserError(
            f"{path} is not a readable PyTorch state dict ({type(e).__name__}): it is damaged or truncated; "
            "copy it again"
        ) from None
    # Training scripts often nest the state dict one level down.
    for key in ("state_dict", "model", "module"):
        if isinstance(state, dict) and isinstance(state.get(key), dict):
            state = state[key]
    if not isinstance(state, dict):
        raise UserError(f"{path} holds a {type(state).__name__}, not a state dict: save the draft's state_dict()")
    return state
