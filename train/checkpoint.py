"""Training checkpoints through orbax's CheckpointManager: one step directory holds

- `state`: the draft's float32 parameters and the optimiser state (sharded arrays, restored straight
  into their shardings),
- `data`: the grain iterator's state (grain's own orbax handler; one file per process),
- `meta`: the step, the losses so far and the resolved config (JSON, for people and for resume checks).

The newest `keep` checkpoints are kept. Saving is synchronous so that a checkpoint written before
a stop (Ctrl-C, SIGTERM, NaN) is complete when the process exits.

A resume takes the newest checkpoint that restores completely. Newer ones that do not (a file
deleted or cut short) are moved to `damaged_checkpoints/` next to `checkpoints/`, for inspection,
so that they are neither resumed from nor overwritten.
"""

from __future__ import annotations

import dataclasses
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from longspec_jax.errors import UserError


@dataclasses.dataclass
class Restored:
    step: int
    state: Any
    meta: dict
    data_iterator: Any  # positioned after the batches of `step`
    skipped: list[str]  # "step N (why)" for each newer checkpoint that did not restore


class CheckpointStore:
    def __init__(self, directory: str | Path, *, keep: int):
        self.directory = Path(directory).resolve()
        self.manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True, enable_async_checkpointing=False),
        )

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state: Any, data_iterator, meta: dict) -> None:
        from grain.checkpoint import CheckpointSave

        self.manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state),
                data=CheckpointSave(data_iterator),
                meta=ocp.args.JsonSave(meta),
            ),
            force=True,
        )
        self.manager.wait_until_finished()

    def restore(self, step: int, abstract_state: Any, data_iterator) -> tuple[Any, dict]:
        """Restores into `abstract_state`'s shapes, dtypes and shardings; sets the iterator in place."""
        from grain.checkpoint import CheckpointRestore

        restored = self.manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract_state),
                data=CheckpointRestore(data_iterator),
                meta=ocp.args.JsonRestore(),
            ),
        )
        return restored.state, restored.meta

    def restore_newest(
        self, abstract_state: Any, make_iterator: Callable[[], Any], check_meta: Callable[[dict], None]
    ) -> Restored | None:
        """The newest checkpoint that restores into `abstract_state` and a fresh iterator (None when there
        is none). `check_meta` refuses, with a UserError, a checkpoint this run must not resume."""
        skipped, damaged = [], []
        for step in sorted(self.manager.all_steps(), reverse=True):
            iterator, error = make_iterator(), None
            try:
                check_meta(self.meta(step))
                state, meta = self.restore(step, abstract_state, iterator)
            except UserError:
                raise
            except Exception as e:  # orbax and tensorstore report a damaged file in many types
                error = e
            if _everywhere(error is None):
                self._set_aside(damaged)
                return Restored(step, state, meta, iterator, skipped)
            skipped.append(f"step {step} ({_reason(error)})")
            damaged.append(step)
        if skipped:
            raise UserError(
                f"no checkpoint in {self.directory} restores: {'; '.join(skipped)}. If they are damaged, move "
                "the directory away to start afresh; if this version cannot read them, use the one that wrote them"
            )
        return None

    def newest_meta(self) -> dict | None:
        """The metadata of the newest checkpoint whose metadata reads (None when there is none)."""
        for step in sorted(self.manager.all_steps(), reverse=True):
            try:
                return self.meta(step)
            except Exception:  # damaged: restore_newest says so, and why, when it skips it
                continue
        return None

    def _set_aside(self, steps: list[int]) -> None:
        if not steps:
            return
        if jax.process_index() == 0:
            aside = self.directory.parent / "damaged_checkpoints"
            aside.mkdir(exist_ok=True)
            for step in steps:
                target, n = aside / str(step), 1
                while target.exists():
                    target, n = aside / f"{step}.{n}", n + 1
                shutil.move(self.directory / str(step), target)
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices("damaged checkpoints set aside")
        self.manager.reload()

    def meta(self, step: int) -> dict:
        """The JSON metadata saved with `step` alone (nothing else is read)."""
        return self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta

    def close(self) -> None:
        self.manager.close()


def _everywhere(ok: bool) -> bool:
    """True when `ok` holds on every process (each reads its own part of a checkpoint)."""
    if jax.process_count() == 1:
        return ok
    return bool(np.all(multihost_utils.process_allgather(np.asarray(ok))))


def _reason(error: Exception) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0][:160]}" if lines else type(error).__name__
