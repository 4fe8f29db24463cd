"""The training loop: set up target, data, mesh, draft and optimiser; resume; step; checkpoint; export.

Run directory layout (`<output_dir>/stage<N>/`): `checkpoints/<step>/` (orbax), `metrics.jsonl`,
`tensorboard/`, and `draft/` (the exported draft: safetensors + config.json) when the stage ends.
A stage N > 1 starts from stage N-1's exported draft when it exists (the paper trains one draft
through all stages), with a fresh optimiser.
"""

from __future__ import annotations

import dataclasses
import math
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx
from jax.experimental import multihost_utils

from longspec_jax.errors import UserError
from train import sharding
from train.checkpoint import CheckpointStore
from train.config import EMBEDDED_TARGET, RANDOM_TARGET, TrainConfig
from train.fingerprint import data_fingerprint, first_difference
from train.lock import OutputLock
from train.metrics import RunLog
from train.optim import make_optimizer
from train.step import compile_step, init_state, step_config


class TrainingStopped(Exception):
    """The run stopped early on purpose (non-finite loss); the message says why and what was kept."""


@dataclasses.dataclass
class TrainResult:
    run_dir: Path
    start_step: int  # completed steps when this process started (after any resume)
    step: int  # completed steps at the end
    losses: list[float]  # one per step run by this process
    draft_path: Path | None  # the export, when the stage finished
    stop_signal: int = 0  # SIGINT / SIGTERM stopped the run: a checkpoint of `step` was saved
    out_of_time: bool = False  # time_limit_s ran out before max_steps: saved and exported at `step`
    notes: list[str] = dataclasses.field(default_factory=list)  # what was taken over or skipped to start

    @property
    def interrupted(self) -> bool:
        return bool(self.stop_signal)


class _StopOnSignal:
    """The first Ctrl-C (SIGINT) or SIGTERM (a scheduler's stop, `kill`) asks the loop to stop after
    the current step, which then saves a checkpoint; a second one of the same signal acts at once.
    Only in the main thread (signals live there). `received` is the first signal's number (0: none)."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.received = 0
        self._previous = {}

    def _handle(self, signum, frame):
        self.received = self.received or signum
        signal.signal(signum, self._previous[signum])

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for signum in self.SIGNALS:
                # None: the previous handler was not set from Python; fall back to the default.
                default = signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL
                self._previous[signum] = signal.signal(signum, self._handle) or default
        return self

    def __exit__(self, *exc):
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)


FINGERPRINT_CACHE = "data_fingerprints.json"  # in output_dir: digests of the data files, by path, size, mtime
OnStep = Callable[[int, dict, dict], None]  # (step, local batch, metrics): a hook for tests


def run_dir_of(cfg: TrainConfig) -> Path:
    return Path(cfg.output_dir) / f"stage{cfg.stage}"


def load_target_for(cfg: TrainConfig):
    """The frozen target, in the compute dtype, loaded on the host (placed by the plan later)."""
    from longspec_jax.target import load_target, random_target

    if cfg.target == RANDOM_TARGET:
        return random_target(cfg.model, seed=cfg.seed, dtype=cfg.compute_dtype)
    path = None if cfg.target == EMBEDDED_TARGET else Path(cfg.target)
    if path is not None and not path.exists():
        raise UserError(f"target {path} does not exist: pass --target PATH (an HF checkpoint directory or .gguf file)")
    with jax.default_device(jax.local_devices(backend="cpu")[0]):
        return load_target(path, dtype=cfg.compute_dtype)


def train(cfg: TrainConfig, *, on_step: OnStep | None = None) -> TrainResult:
    """Train the selected stage to its end, resuming from the newest checkpoint that restores. Holds
    the output directory's lock throughout: a second trainer on the same directory is refused."""
    from train.data import find_files

    cfg.validate()
    deadline = time.monotonic() + cfg.time_limit_s if cfg.time_limit_s else math.inf
    _check_output_dir(cfg)
    files = find_files(cfg.current.data)  # a wrong data path fails now, not after loading the target
    if cfg.init_draft and not Path(cfg.init_draft).exists():
        raise UserError(
            f"init_draft={cfg.init_draft} does not exist: give an exported draft directory or leave it unset"
        )
    sharding.maybe_initialize_distributed()
    lock = _on_process_0(lambda: OutputLock.acquire(cfg.output_dir))
    try:
        notes = [lock.notice] if lock is not None and lock.notice else []
        return _train_locked(cfg, files, deadline, notes, on_step)
    finally:
        if lock is not None:
            lock.release()


def _train_locked(cfg: TrainConfig, files, deadline: float, notes: list[str], on_step: OnStep | None) -> TrainResult:
    from train.data import batch_iterator

    stage = cfg.current
    run_dir = run_dir_of(cfg)
    cache = Path(cfg.output_dir) / FINGERPRINT_CACHE if jax.process_index() == 0 else None
    fingerprint = data_fingerprint(files, cache)
    # Refuse a changed config or changed data now, before the target loads.
    _on_process_0(lambda: _check_resumable_early(run_dir / "checkpoints", cfg, fingerprint))
    mesh = sharding.make_mesh(cfg.mesh)
    accum, rows_per_process = _batch_layout(cfg, mesh)
    target = load_target_for(cfg)
    store = CheckpointStore(run_dir / "checkpoints", keep=cfg.keep_checkpoints)
    try:
        corpus, total_steps = _load_corpus(cfg, target)
        optimizer, schedule = make_optimizer(cfg, total_steps)
        draft = _initial_draft(cfg, target)
        target_graphdef, target_params = nnx.split(target.model)
        target_params = jax.device_put(target_params, sharding.param_shardings(target_params, mesh))
        draft_graphdef, draft_params = nnx.split(draft.block)
        # Host copies in: every process passes the same values, which jit then places by the plan.
        state = init_state(jax.device_get(nnx.to_pure_dict(draft_params)), optimizer, mesh)
        step_fn = compile_step(target_graphdef, draft_graphdef, optimizer, step_config(cfg), mesh, target_params, state)

        def make_data():
            return batch_iterator(
                corpus,
                seq_len=stage.seq_len,
                batch_size=rows_per_process,
                seed=cfg.seed,
                process_index=jax.process_index(),
                process_count=jax.process_count(),
            )

        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
        restored = store.restore_newest(
            abstract, make_data, lambda meta: _check_resumable(meta, cfg, fingerprint, store.directory)
        )
        if restored is None:
            step, data = 0, make_data()
        else:
            state, data, step = restored.state, restored.data_iterator, restored.step
            if restored.skipped:
                notes.append(
                    f"note: checkpoint {', '.join(restored.skipped)} does not restore: set aside in "
                    f"{store.directory.parent / 'damaged_checkpoints'}; resuming from step {step}"
                )
        start_step = step
        meta_config = _jsonable(dataclasses.asdict(cfg))
        base_key = jax.random.key(cfg.seed)
        log = RunLog(run_dir, start_step=step, total_steps=total_steps, enabled=jax.process_index() == 0)
        for note in notes:
            log.message(note)
        if cfg.target != RANDOM_TARGET and _shape_fields(target.config) != _shape_fields(cfg.model):
            log.message(
                f"note: the target's shapes differ from config {cfg.name!r}'s `model` (used only for memory "
                "plans); training uses the target's own"
            )
        if step:
            log.message(f"resumed from {store.directory}/{step}")
        losses: list[float] = []
        last_logged = step
        out_of_time, stop_signal = False, 0

        def save():
            meta = {"step": step, "config": meta_config, "data_fingerprint": fingerprint}
            store.save(step, state, data, meta)

        with _StopOnSignal() as signals:
            try:
                while step < total_steps and not stop_signal and not out_of_time:
                    local = next(data)
                    batch = sharding.global_batch(
                        {k: v.reshape(accum, rows_per_process // accum, stage.seq_len) for k, v in local.items()},
                        mesh,
                    )
                    state, metrics = step_fn(target_params, state, batch, jax.random.fold_in(base_key, step))
                    step += 1
                    metrics = {k: float(v) for k, v in metrics.items()}
                    if not math.isfinite(metrics["loss"]):
                        kept = store.latest_step()
                        raise TrainingStopped(
                            f"loss is {metrics['loss']} at step {step}: stopped. The last good checkpoint "
                            f"({'none yet' if kept is None else f'step {kept}'}) is kept in {store.directory}; "
                            "lower the learning rate (--set lr=...) and run again to resume from it"
                        )
                    losses.append(metrics["loss"])
                    log.count_tokens(stage.batch_size * stage.seq_len)
                    if on_step is not None:
                        on_step(step, local, metrics)
                    out_of_time, stop_signal = _agreed(time.monotonic() >= deadline, signals.received)
                    out_of_time = bool(out_of_time)
                    if step % cfg.log_every == 0 or step == total_steps or out_of_time:
                        log.log(step, {**metrics, "lr": float(schedule(step - 1))}, steps_done=step - last_logged)
                        last_logged = step
                    if step % cfg.checkpoint_every == 0 or step == total_steps or out_of_time:
                        save()
                if stop_signal:
                    if store.latest_step() != step:
                        save()
                    log.message(
                        f"interrupted ({signal.Signals(stop_signal).name}): saved step {step} in "
                        f"{store.directory}; run the same command to resume"
                    )
                    return TrainResult(
                        run_dir, start_step, step, losses, draft_path=None, stop_signal=stop_signal, notes=notes
                    )
                if out_of_time and step < total_steps:
                    log.message(
                        f"time limit ({cfg.time_limit_s:g} s) reached at step {step} of {total_steps}: saved "
                        f"in {store.directory} and exported; run the same command to continue"
                    )
            finally:
                log.close()
    finally:
        store.close()
    draft_path = _export(draft_graphdef, state["params"], cfg, run_dir / "draft", draft.candidate_tokens)
    return TrainResult(
        run_dir=run_dir,
        start_step=start_step,
        step=step,
        losses=losses,
        draft_path=draft_path,
        out_of_time=out_of_time and step < total_steps,
        notes=notes,
    )


def _check_output_dir(cfg: TrainConfig) -> None:
    """The run directory must be creatable: no file stands where it or a directory above it goes."""
    run_dir = run_dir_of(cfg)
    for path in (run_dir, *run_dir.parents):
        if path.exists():
            if not path.is_dir():
                raise UserError(
                    f"output_dir={cfg.output_dir}: {path} is a file, not a directory: "
                    "choose another output_dir (--set output_dir=...)"
                )
            return


def _on_process_0[T](fn: Callable[[], T]) -> T | None:
    """fn() on process 0 only (None elsewhere); a UserError it raises stops every process."""
    result, error = None, None
    if jax.process_index() == 0:
        try:
            result = fn()
        except UserError as e:
            error = e
    if _agreed(error is not None)[0]:
        raise error or UserError("process 0 refused to start: its output says why")
    return result


def _agreed(*values: int) -> tuple[int, ...]:
    """Process 0's `values` on every process, so that all stop at the same step for the same reason."""
    if jax.process_count() == 1:
        return tuple(int(v) for v in values)
    agreed = multihost_utils.broadcast_one_to_all(jnp.asarray([int(v) for v in values], jnp.int32))
    return tuple(int(v) for v in agreed)


def _load_corpus(cfg: TrainConfig, target):
    """The tokenised corpus of the selected stage and the stage's step count (max_steps or one epoch)."""
    from train.data import load_corpus, text_encoder

    stage = cfg.current
    corpus = load_corpus(
        stage.data,
        text_encoder(target.tokenizer, target.config),
        target.config,
        text_field=stage.text_field,
        prompt_field=stage.prompt_field,
        response_field=stage.response_field,
        cache_dir=cfg.data_cache_dir,
        repeats=stage.data_repeats,
    )
    total_steps = stage.max_steps or corpus.steps_per_epoch(stage.seq_len, stage.batch_size)
    if total_steps < 1:
        raise UserError(
            f"the data ({corpus.num_tokens} tokens) is smaller than one batch of "
            f"{stage.batch_size} x {stage.seq_len} tokens: add data or lower batch_size / seq_len"
        )
    return corpus, total_steps


def _batch_layout(cfg: TrainConfig, mesh) -> tuple[int, int]:
    """(accumulation steps, rows this process loads per step)."""
    stage = cfg.current
    dp = sharding.data_parallel_size(mesh)
    per_micro = stage.micro_batch_size * dp
    if stage.batch_size % per_micro:
        raise UserError(
            f"batch_size={stage.batch_size} is not a multiple of micro_batch_size x data-parallel "
            f"devices = {stage.micro_batch_size} x {dp}: change batch_size or micro_batch_size"
        )
    if stage.batch_size % jax.process_count():
        raise UserError(f"batch_size={stage.batch_size} does not split over {jax.process_count()} processes")
    return stage.batch_size // per_micro, stage.batch_size // jax.process_count()


def _initial_draft(cfg: TrainConfig, target):
    from longspec_jax.draft_io import init_draft, load_draft

    if cfg.init_draft:
        return load_draft(cfg.init_draft, target)
    previous = Path(cfg.output_dir) / f"stage{cfg.stage - 1}" / "draft"
    if cfg.stage > 1 and previous.is_dir():
        return load_draft(previous, target)
    return init_draft(target, cfg.seed)


def _export(draft_graphdef, params, cfg: TrainConfig, path: Path, candidate_tokens=None) -> Path | None:
    """Write the trained draft in the compute dtype with Draft.save (process 0), with the candidate
    tokens of the draft it started from (init_draft or the previous stage's; none for a new draft):
    training moves the weights, not the vocabulary its text uses."""
    from longspec_jax.draft_io import Draft

    host = multihost_utils.process_allgather(params, tiled=True)  # every process holds all of it
    if jax.process_index() != 0:
        return None
    return Draft(nnx.merge(draft_graphdef, host), candidate_tokens).cast(jnp.dtype(cfg.compute_dtype)).save(path)


# What must not change between a checkpoint and its resumption for the run to continue exactly.
# The data is compared by content (its fingerprint), not by the paths that name it.
RESUME_FIELDS = ("model", "seed", "stage", "gamma", "num_anchors")
RESUME_STAGE_FIELDS = (
    "seq_len",
    "batch_size",
    "lr",
    "anchor_offset",
    "max_offset",
    "max_steps",
    "text_field",
    "prompt_field",
    "response_field",
)


def _check_resumable_early(checkpoints: Path, cfg: TrainConfig, fingerprint: list[dict]) -> None:
    """_check_resumable against the newest readable checkpoint, if any (nothing is created)."""
    if not checkpoints.is_dir():
        return
    store = CheckpointStore(checkpoints, keep=cfg.keep_checkpoints)
    try:
        _check_resumable(store.newest_meta(), cfg, fingerprint, store.directory)
    finally:
        store.close()


def _check_resumable(saved: dict | None, cfg: TrainConfig, fingerprint: list[dict], directory: Path) -> None:
    """A UserError when the checkpoint whose metadata is `saved` was made by another config or data."""
    if saved is None:
        return
    fix = "a new output_dir (--set output_dir=...) to start afresh"
    now = _jsonable(dataclasses.asdict(cfg))
    pairs = [(k, saved["config"][k], now[k]) for k in RESUME_FIELDS]
    before, after = saved["config"]["stages"][cfg.stage - 1], now["stages"][cfg.stage - 1]
    pairs += [(k, before[k], after[k]) for k in RESUME_STAGE_FIELDS]
    # Repeats decide which records the data iterator's saved position points at (older
    # checkpoints predate the field: no repeats).
    pairs.append(("data_repeats", before.get("data_repeats", []), after["data_repeats"]))
    pairs.append(("distill", saved["config"].get("distill", 0.0), now["distill"]))  # the loss itself
    if "data_fingerprint" not in saved:  # written before fingerprints were kept: compare the paths
        pairs.append(("data", before["data"], after["data"]))
    changed = [(k, a, b) for k, a, b in pairs if a != b]
    if changed:
        key, a, b = changed[0]
        raise UserError(
            f"the checkpoint in {directory} was made with {key}={a}, this run has {key}={b}: "
            f"use the same config to resume, or {fix}"
        )
    difference = first_difference(saved.get("data_fingerprint", fingerprint), fingerprint)
    if difference:
        raise UserError(
            f"the checkpoint in {directory} was trained on other data ({difference}): pass the original "
            f"data (--data ...) to resume, or {fix}"
        )


def _shape_fields(model) -> tuple:
    return (
        model.vocab_size,
        model.hidden_size,
        model.intermediate_size,
        model.num_layers,
        model.num_heads,
        model.num_kv_heads,
        model.head_dim,
    )


def _jsonable(value):
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value
