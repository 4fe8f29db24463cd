"""What keeps a run's work safe: the output directory's lock, the fall-back past damaged checkpoints,
metrics rows that a resume does not duplicate, and the data fingerprint that resume compares."""

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import grain
import jax.numpy as jnp
import numpy as np
import pytest

from longspec_jax.errors import UserError
from train.checkpoint import CheckpointStore
from train.fingerprint import data_fingerprint, first_difference
from train.lock import LOCK_NAME, OutputLock
from train.metrics import RunLog

REPO = Path(__file__).resolve().parent.parent


# ---- the output directory's lock ----


def test_a_second_lock_on_the_same_directory_is_refused_naming_the_holder(tmp_path):
    with OutputLock.acquire(tmp_path) as first:
        assert first.notice is None
        with pytest.raises(UserError, match=f"pid {os.getpid()} on host {socket.gethostname()}"):
            OutputLock.acquire(tmp_path)
    with OutputLock.acquire(tmp_path) as again:  # released: free, and nothing to take over
        assert again.notice is None
    assert (tmp_path / LOCK_NAME).read_text() == ""


def _holder_process(out_dir: Path) -> subprocess.Popen:
    """Another process that takes the lock and waits to be killed."""
    code = (
        f"from train.lock import OutputLock; OutputLock.acquire({str(out_dir)!r}); print('locked', flush=True); input()"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code], cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert child.stdout.readline().strip() == "locked"
    return child


def test_a_lock_left_by_a_killed_trainer_is_taken_over_with_a_notice(tmp_path):
    child = _holder_process(tmp_path)
    try:
        with pytest.raises(UserError, match=f"pid {child.pid} "):
            OutputLock.acquire(tmp_path)
    finally:
        child.send_signal(signal.SIGKILL)  # no clean-up runs: the file still names it
        child.wait()
    assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == child.pid
    with OutputLock.acquire(tmp_path) as lock:
        assert lock.notice and f"pid {child.pid} " in lock.notice and "no longer running" in lock.notice
        assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()


def test_train_refuses_an_output_dir_in_use_before_loading_anything(tmp_path):
    from train.config import apply_overrides, load_config
    from train.trainer import train

    cfg = apply_overrides(load_config("tiny"), [f"output_dir={tmp_path}"])
    with OutputLock.acquire(tmp_path):
        with pytest.raises(UserError, match=f"in use by another trainer \\(pid {os.getpid()}"):
            train(cfg)
    assert not (tmp_path / "stage1").exists()


def test_the_cli_refuses_an_output_dir_another_process_trains_in(tmp_path):
    child = _holder_process(tmp_path)
    try:
        out = subprocess.run(
            [sys.executable, "-m", "train.run", "--config", "tiny", "--set", f"output_dir={tmp_path}"],
            cwd=REPO,
            env={**os.environ, "JAX_PLATFORMS": "cpu"},
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines()[-1].startswith("error: ") and f"pid {child.pid} " in out.stderr


# ---- checkpoints: the newest one that restores ----


def _numbers_iterator():
    return iter(grain.MapDataset.range(1000).to_iter_dataset())


def _store_with_steps(directory: Path, steps=(1, 2, 3)) -> CheckpointStore:
    """Checkpoint `s` holds w = s and an iterator that has handed out 0..s-1."""
    store = CheckpointStore(directory, keep=5)
    it = _numbers_iterator()
    for s in steps:
        next(it)
        store.save(s, {"w": jnp.full((4,), float(s))}, it, {"step": s})
    return store


def _abstract():
    import jax

    return {"w": jax.ShapeDtypeStruct((4,), jnp.float32)}


DAMAGE = {
    "state metadata deleted": lambda d: (d / "state" / "_METADATA").unlink(),
    "state manifest cut short": lambda d: os.truncate(d / "state" / "manifest.ocdbt", 10),
    "data iterator state deleted": lambda d: (d / "data" / "process_0-of-1.json").unlink(),
    "metadata cut short": lambda d: os.truncate(d / "meta" / "metadata", 5),
}


@pytest.mark.parametrize("damage", DAMAGE.values(), ids=DAMAGE.keys())
def test_a_damaged_newest_checkpoint_is_set_aside_and_the_previous_one_restored(tmp_path, damage):
    store = _store_with_steps(tmp_path / "checkpoints")
    damage(tmp_path / "checkpoints" / "3")
    restored = store.restore_newest(_abstract(), _numbers_iterator, lambda meta: None)
    assert restored.step == 2 and restored.meta == {"step": 2}
    np.testing.assert_array_equal(np.asarray(restored.state["w"]), np.full(4, 2.0))
    assert next(restored.data_iterator) == 2  # the iterator is where step 2 left it
    assert len(restored.skipped) == 1 and restored.skipped[0].startswith("step 3 (")
    assert (tmp_path / "damaged_checkpoints" / "3").is_dir() and not (tmp_path / "checkpoints" / "3").exists()
    assert store.manager.all_steps() == [1, 2]
    store.save(3, restored.state, restored.data_iterator, {"step": 3})  # the step can be saved again
    assert store.latest_step() == 3
    store.close()


def test_when_no_checkpoint_restores_nothing_is_moved_and_the_error_names_each(tmp_path):
    store = _store_with_steps(tmp_path / "checkpoints", steps=(1, 2))
    for s in (1, 2):
        (tmp_path / "checkpoints" / str(s) / "state" / "_METADATA").unlink()
    with pytest.raises(UserError, match="no checkpoint .* restores: step 2 .*; step 1 .*move the directory away"):
        store.restore_newest(_abstract(), _numbers_iterator, lambda meta: None)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit()) == ["1", "2"]
    assert not (tmp_path / "damaged_checkpoints").exists()
    store.close()


def test_a_refused_checkpoint_is_not_taken_for_damaged(tmp_path):
    store = _store_with_steps(tmp_path / "checkpoints", steps=(1,))

    def refuse(meta):
        raise UserError("other config")

    with pytest.raises(UserError, match="other config"):
        store.restore_newest(_abstract(), _numbers_iterator, refuse)
    assert store.manager.all_steps() == [1]
    store.close()


# ---- metrics rows ----


def test_a_resumed_log_drops_rows_beyond_its_start_and_a_torn_last_row(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in (2, 4, 6, 8)) + '{"step": 1')
    log = RunLog(tmp_path, start_step=4, total_steps=10)
    log.count_tokens(1)
    log.log(6, {"loss": 0.5, "lr": 0.1}, steps_done=2)
    log.close()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["step"], r["loss"]) for r in rows] == [(2, 1.0), (4, 1.0), (6, 0.5)]


# ---- the data fingerprint ----


def test_the_fingerprint_follows_content_not_the_path(tmp_path, monkeypatch):
    data = tmp_path / "a.jsonl"
    data.write_text('{"text": "one"}\n')
    absolute = data_fingerprint([data])
    monkeypatch.chdir(tmp_path)
    assert first_difference(absolute, data_fingerprint([Path("a.jsonl")])) is None
    copy = tmp_path / "elsewhere.jsonl"
    copy.write_bytes(data.read_bytes())
    assert first_difference(absolute, data_fingerprint([copy])) is None
    data.write_text('{"text": "two"}\n')  # same size, other bytes, replaced in place
    assert "a.jsonl" in first_difference(absolute, data_fingerprint([data]))
    assert first_difference(absolute, data_fingerprint([data, copy])) == "1 data files then, 2 now"


def test_the_fingerprint_cache_is_used_until_the_file_changes(tmp_path, monkeypatch):
    import train.fingerprint as fingerprint

    data, cache = tmp_path / "a.txt", tmp_path / "cache.json"
    data.write_text("abc")
    first = data_fingerprint([data], cache)
    monkeypatch.setattr(fingerprint, "_sha256", lambda path: pytest.fail("hashed again"))
    assert data_fingerprint([data], cache) == first
    os.utime(data, ns=(1, 1))  # touched: read again
    monkeypatch.setattr(fingerprint, "_sha256", lambda path: "rehashed")
    assert data_fingerprint([data], cache)[0]["sha256"] == "rehashed"
