"""The training loop with tiny.py on CPU: the loss falls, an interrupted run resumes exactly where an
uninterrupted one would be, a non-finite loss keeps the last good checkpoint, the export loads."""

import dataclasses
import json
import os
import signal
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from longspec_jax.draft_io import load_draft
from longspec_jax.errors import UserError
from longspec_jax.target import random_target
from train.checkpoint import CheckpointStore
from train.config import apply_overrides, load_config
from train.trainer import TrainingStopped, train

STEPS = 12
NAMES = ["Ada", "Bo", "Cy", "Di", "Ed", "Flo"]
THINGS = ["apples", "books", "coins", "pens"]


@pytest.fixture(scope="module")
def corpus_file(tmp_path_factory):
    """Short structured stories (learnable) of varied lengths, so shuffling changes the stream."""
    path = tmp_path_factory.mktemp("corpus") / "stories.jsonl"
    lines = []
    for i in range(96):
        a, b, thing = NAMES[i % 6], NAMES[(i * 5 + 1) % 6], THINGS[i % 4]
        n, k = 3 + i % 5, 1 + i % 3
        lines.append(
            json.dumps(
                {
                    "text": f"{a} has {n} {thing}. {a} gives {k} {thing} to {b}. "
                    f"Now {a} has {n - k} {thing} and {b} has {k} {thing}."
                }
            )
        )
    path.write_text("\n".join(lines) + "\n")
    return path


def tiny_cfg(corpus_file, out_dir, *overrides):
    return apply_overrides(
        load_config("tiny"),
        [
            f"data={corpus_file}",
            f"output_dir={out_dir}",
            f"data_cache_dir={out_dir.parent / 'cache'}",
            f"max_steps={STEPS}",
            "checkpoint_every=100",
            "log_every=4",
            *overrides,
        ],
    )


class Recorder:
    """on_step hook: the batch each step saw; optionally a signal (Ctrl-C's SIGINT) after step `interrupt_at`."""

    def __init__(self, interrupt_at=None, signum=signal.SIGINT):
        self.batches, self.interrupt_at, self.signum = {}, interrupt_at, signum

    def __call__(self, step, batch, metrics):
        self.batches[step] = batch["tokens"].copy()
        if step == self.interrupt_at:
            signal.raise_signal(self.signum)


@pytest.fixture(scope="module")
def uninterrupted(corpus_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("full") / "run"
    recorder = Recorder()
    result = train(tiny_cfg(corpus_file, out), on_step=recorder)
    return result, recorder


def test_loss_falls(uninterrupted):
    result, _ = uninterrupted
    assert result.step == STEPS and len(result.losses) == STEPS and not result.interrupted
    start = result.losses[0]
    assert abs(start - np.log(320)) < 0.3  # a fresh draft is near uniform over the 320-token vocabulary
    assert np.mean(result.losses[-3:]) < start - 1.0, result.losses


def test_metrics_tensorboard_and_export(uninterrupted, corpus_file):
    result, _ = uninterrupted
    records = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [4, 8, 12]
    assert {"loss", "tokens_per_s", "lr", "grad_norm", "accuracy"} <= set(records[0])
    assert records[-1]["loss"] == pytest.approx(result.losses[-1])
    assert list((result.run_dir / "tensorboard").glob("events.out.tfevents.*"))
    cfg = load_config("tiny")
    draft = load_draft(result.draft_path, random_target(cfg.model, seed=cfg.seed))
    assert draft.block.mlp.up_proj.kernel[...].shape == (cfg.model.hidden_size, cfg.model.intermediate_size)
    assert (result.draft_path / "model.safetensors").is_file() and (result.draft_path / "config.json").is_file()


def test_interrupted_run_resumes_exactly(uninterrupted, corpus_file, tmp_path):
    full, full_batches = uninterrupted
    out = tmp_path / "run"
    first = Recorder(interrupt_at=5)
    stopped = train(tiny_cfg(corpus_file, out), on_step=first)
    assert stopped.interrupted and stopped.stop_signal == signal.SIGINT and stopped.step == 5
    assert CheckpointStore(out / "stage1" / "checkpoints", keep=2).latest_step() == 5
    second = Recorder()
    resumed = train(tiny_cfg(corpus_file, out), on_step=second)
    assert resumed.start_step == 5 and resumed.step == STEPS
    assert stopped.losses + resumed.losses == full.losses  # bit-identical on CPU
    for step in range(1, STEPS + 1):
        seen = first.batches.get(step, second.batches.get(step))
        assert np.array_equal(seen, full_batches.batches[step]), f"step {step} saw different data"
    np.testing.assert_array_equal(
        np.asarray(
            load_draft(resumed.draft_path, random_target(load_config("tiny").model)).block.mlp.up_proj.kernel[...]
        ),
        np.asarray(load_draft(full.draft_path, random_target(load_config("tiny").model)).block.mlp.up_proj.kernel[...]),
    )


def test_non_finite_loss_stops_and_keeps_the_last_good_checkpoint(corpus_file, tmp_path):
    out = tmp_path / "run"
    recorder = Recorder()
    # An absurd learning rate overflows the weights within a few steps (the first step's lr is 0).
    # This run also computes in bfloat16, as on GPU: its checkpoints must hold float32 master state.
    cfg = tiny_cfg(corpus_file, out, "lr=1e30", "checkpoint_every=1", "compute_dtype=bfloat16")
    with pytest.raises(TrainingStopped, match="last good checkpoint") as info:
        train(cfg, on_step=recorder)
    good_steps = max(recorder.batches)  # on_step runs only for finite steps
    assert 1 <= good_steps < STEPS
    assert f"at step {good_steps + 1}" in str(info.value)
    store = CheckpointStore(out / "stage1" / "checkpoints", keep=cfg.keep_checkpoints)
    assert store.latest_step() == good_steps
    restored = store.manager.restore(good_steps, args=ocp.args.Composite(state=ocp.args.StandardRestore()))
    assert all(np.all(np.isfinite(np.asarray(x))) for x in jax.tree.leaves(restored.state["params"]))
    floats = {
        np.asarray(x).dtype for x in jax.tree.leaves(restored.state) if np.issubdtype(np.asarray(x).dtype, np.floating)
    }
    assert floats == {np.dtype(np.float32)}  # master weights and Adam moments
    assert not (out / "stage1" / "draft").exists()


def test_a_later_stage_starts_from_the_previous_stages_draft(uninterrupted, corpus_file):
    from train.trainer import _initial_draft

    result, _ = uninterrupted
    cfg = tiny_cfg(corpus_file, result.run_dir.parent)
    cfg = dataclasses.replace(cfg, stages=cfg.stages * 2, stage=2)
    target = random_target(cfg.model, seed=cfg.seed)
    continued = _initial_draft(cfg, target).block.mlp.up_proj.kernel[...]
    exported = load_draft(result.draft_path, target).block.mlp.up_proj.kernel[...]
    fresh = _initial_draft(dataclasses.replace(cfg, stage=1), target).block.mlp.up_proj.kernel[...]
    np.testing.assert_array_equal(np.asarray(continued), np.asarray(exported))
    assert not np.allclose(np.asarray(continued), np.asarray(fresh))


def test_init_draft_starts_a_stage_from_the_given_weights(uninterrupted, corpus_file, tmp_path):
    from train.trainer import _initial_draft

    result, _ = uninterrupted
    cfg = tiny_cfg(corpus_file, tmp_path / "continued", f"init_draft={result.draft_path}")
    target = random_target(cfg.model, seed=cfg.seed)
    started = _initial_draft(cfg, target).block.mlp.up_proj.kernel[...]
    exported = load_draft(result.draft_path, target).block.mlp.up_proj.kernel[...]
    np.testing.assert_array_equal(np.asarray(started), np.asarray(exported))


def test_a_stage_from_a_draft_with_candidate_tokens_exports_them(uninterrupted, corpus_file, tmp_path):
    result, _ = uninterrupted
    cfg = tiny_cfg(corpus_file, tmp_path / "run", "max_steps=2")
    target = random_target(cfg.model, seed=cfg.seed)
    ids = np.arange(0, cfg.model.vocab_size, 3, dtype=np.int32)
    start = load_draft(result.draft_path, target).with_candidate_tokens(ids).save(tmp_path / "with_candidates")
    trained = train(apply_overrides(cfg, [f"init_draft={start}"]))
    np.testing.assert_array_equal(load_draft(trained.draft_path, target).candidate_tokens, ids)
    assert load_draft(result.draft_path, target).candidate_tokens is None  # a new draft has none


def test_a_missing_init_draft_is_refused_before_training(corpus_file, tmp_path):
    cfg = tiny_cfg(corpus_file, tmp_path / "run", f"init_draft={tmp_path / 'nowhere'}")
    with pytest.raises(UserError, match="init_draft=.*nowhere does not exist"):
        train(cfg)
    assert not (tmp_path / "run" / "stage1").exists()


def test_resuming_with_a_different_data_config_is_refused(uninterrupted, corpus_file):
    result, _ = uninterrupted
    with pytest.raises(UserError, match="seq_len=64, this run has seq_len=32"):
        train(tiny_cfg(corpus_file, result.run_dir.parent, "seq_len=32"))
    with pytest.raises(UserError, match=r"data_repeats=\[\], this run has data_repeats=\[2\]"):
        train(tiny_cfg(corpus_file, result.run_dir.parent, "data_repeats=2"))
    with pytest.raises(UserError, match=r"distill=0.0, this run has distill=0.5"):
        train(tiny_cfg(corpus_file, result.run_dir.parent, "distill=0.5"))


def test_sigterm_saves_and_a_damaged_newest_checkpoint_is_skipped_without_duplicate_rows(
    uninterrupted, corpus_file, tmp_path
):
    full, full_batches = uninterrupted
    out = tmp_path / "run"
    overrides = ("checkpoint_every=4", "log_every=1")
    stopped = train(tiny_cfg(corpus_file, out, *overrides), on_step=Recorder(interrupt_at=9, signum=signal.SIGTERM))
    assert stopped.stop_signal == signal.SIGTERM and stopped.step == 9
    checkpoints = out / "stage1" / "checkpoints"
    assert CheckpointStore(checkpoints, keep=2).manager.all_steps() == [8, 9]
    os.truncate(checkpoints / "9" / "state" / "manifest.ocdbt", 10)  # a write cut short
    second = Recorder()
    resumed = train(tiny_cfg(corpus_file, out, *overrides), on_step=second)
    assert resumed.start_step == 8 and resumed.step == STEPS
    assert any("step 9 (" in n and "resuming from step 8" in n for n in resumed.notes), resumed.notes
    assert (out / "stage1" / "damaged_checkpoints" / "9").is_dir()
    assert stopped.losses[:8] + resumed.losses == full.losses  # steps 9.. replayed exactly
    for step in range(9, STEPS + 1):
        assert np.array_equal(second.batches[step], full_batches.batches[step]), f"step {step} saw other data"
    rows = [json.loads(line) for line in (resumed.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))  # step 9 once, although run twice
    assert [r["loss"] for r in rows] == pytest.approx(full.losses)


def test_resume_compares_the_data_by_content_not_by_path(uninterrupted, corpus_file, tmp_path, monkeypatch):
    result, _ = uninterrupted
    changed = tmp_path / corpus_file.name
    changed.write_text(corpus_file.read_text().replace("apples", "grapes", 1))  # same size, other data
    with pytest.raises(UserError, match="trained on other data .*stories.jsonl.*--set output_dir"):
        train(tiny_cfg(changed, result.run_dir.parent))
    monkeypatch.chdir(corpus_file.parent)  # the same file by a relative path resumes (nothing left to run)
    again = train(tiny_cfg(Path(corpus_file.name), result.run_dir.parent))
    assert again.start_step == again.step == STEPS and again.losses == []


def test_time_limit_stops_saves_exports_and_resumes(corpus_file, tmp_path):
    out = tmp_path / "run"
    # A limit already spent when the first step ends: the run stops after exactly one step.
    first = train(tiny_cfg(corpus_file, out, "time_limit_s=1e-9"))
    assert first.out_of_time and first.step == 1 and not first.interrupted
    assert (first.draft_path / "model.safetensors").is_file()
    assert CheckpointStore(out / "stage1" / "checkpoints", keep=2).latest_step() == 1
    records = [json.loads(line) for line in (first.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1]
    rest = train(tiny_cfg(corpus_file, out))
    assert rest.start_step == 1 and rest.step == STEPS and not rest.out_of_time


def test_negative_time_limit_is_a_clear_error(corpus_file, tmp_path):
    with pytest.raises(UserError, match="time_limit_s"):
        train(tiny_cfg(corpus_file, tmp_path / "run", "time_limit_s=-1"))
