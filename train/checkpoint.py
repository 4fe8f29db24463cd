"""Training checkpoints through orbax's CheckpointManager: one step directory holds

- `state`: the draft's float32 parameters and the optimiser state (sharded arrays, restored straight
  into their shardings),
- `data`: the grain iterator's state (grain's own orbax handler; one file per process),
- `meta`: the step, the losses so far and the resolved config (JSON, for people and for resume checks).

The newest `keep` checkpoints are kept. Saving is synchronous so that a checkpoint written before
a stop (Ctrl-C, NaN) is complete when the process exits.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orbax.checkpoint as ocp


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

    def meta(self, step: int) -> dict:
        """The JSON metadata saved with `step` alone (nothing else is read)."""
        return self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta

    def close(self) -> None:
        self.manager.close()
