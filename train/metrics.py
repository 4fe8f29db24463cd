"""Run output: a tqdm progress bar (step, loss, tokens/s, lr, ETA), `metrics.jsonl` and
TensorBoard event files under the run directory. Only process 0 writes.

A resumed run replays the steps after its checkpoint, so rows beyond `start_step` are dropped from
`metrics.jsonl` (and TensorBoard is told to purge them) before the replay writes them again: each
step has one row.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path


class RunLog:
    def __init__(self, run_dir: str | Path, *, start_step: int, total_steps: int, enabled: bool = True):
        self.enabled = enabled
        self.run_dir = Path(run_dir)
        self._last_time = time.perf_counter()
        self._tokens_since = 0
        self._jsonl = self._tb = self._bar = None
        if not enabled:
            return
        from tensorboardX import SummaryWriter
        from tqdm import tqdm

        self.run_dir.mkdir(parents=True, exist_ok=True)
        path = self.run_dir / "metrics.jsonl"
        _keep_rows_up_to(path, start_step)
        self._jsonl = open(path, "a")
        self._tb = SummaryWriter(str(self.run_dir / "tensorboard"), purge_step=start_step + 1)
        self._bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True)

    def count_tokens(self, n: int) -> None:
        self._tokens_since += n

    def log(self, step: int, metrics: dict[str, float], *, steps_done: int) -> None:
        """Record metrics for `step`; tokens/s covers the tokens counted since the previous call."""
        now = time.perf_counter()
        elapsed = max(now - self._last_time, 1e-9)
        record = {"step": step, **metrics, "tokens_per_s": self._tokens_since / elapsed}
        self._last_time, self._tokens_since = now, 0
        if not self.enabled:
            return
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        for key, value in record.items():
            if key != "step":
                self._tb.add_scalar(f"train/{key}", value, step)
        self._bar.update(steps_done)
        self._bar.set_postfix(
            loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_s']:.0f}", lr=f"{record['lr']:.2e}"
        )

    def message(self, text: str) -> None:
        if self.enabled:
            self._bar.write(text)

    def close(self) -> None:
        if self.enabled:
            self._bar.close()
            self._tb.close()
            self._jsonl.close()


def _keep_rows_up_to(path: Path, step: int) -> None:
    """Rewrite `path` without rows after `step` (and without a row cut short by a crash)."""
    if not path.is_file():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] <= step:
            kept.append(line + "\n")
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(kept))
    os.replace(tmp, path)
