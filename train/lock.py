"""One trainer per output directory: an exclusive `fcntl.flock` on `<output_dir>/trainer.lock`.

The OS drops a flock when its process ends however it ends (crash, kill -9), so a lock left behind
never blocks: the next trainer takes it and says whose it was. The file names its holder (pid, host,
start time) so that a refused trainer can say which run holds the directory. The file is emptied on
release, never deleted: deleting it would let a trainer that opened the old file and one that creates
a new one both hold "the" lock.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
from pathlib import Path

from longspec_jax.errors import UserError

LOCK_NAME = "trainer.lock"


class OutputLock:
    """Held from `acquire` until `release` (or the process ends). `notice` says what was taken over."""

    def __init__(self, path: Path, fd: int | None, notice: str | None):
        self.path, self._fd, self.notice = path, fd, notice

    @classmethod
    def acquire(cls, output_dir: str | Path) -> OutputLock:
        path = Path(output_dir) / LOCK_NAME
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = _describe(_read_holder(fd))
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise UserError(
                    f"{output_dir} is in use by another trainer ({holder}): wait for it to finish or stop it, "
                    "or train into another directory (--set output_dir=...)"
                ) from None
            # File systems without flock support (some network mounts): run unprotected, and say so.
            return cls(path, None, f"note: {path} cannot be locked ({e.strerror}): start one trainer at a time here")
        previous = _read_holder(fd)
        notice = None
        if previous:
            notice = (
                f"note: took over the lock in {output_dir} left by a trainer that ended without releasing it "
                f"({_describe(previous)})"
            )
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(_me()).encode(), 0)
        os.fsync(fd)
        return cls(path, fd, notice)

    def release(self) -> None:
        if self._fd is None:
            return
        os.ftruncate(self._fd, 0)
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> OutputLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _me() -> dict:
    return {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}


def _read_holder(fd: int) -> dict:
    raw = os.pread(fd, 4096, 0)
    try:
        holder = json.loads(raw) if raw.strip() else {}
    except ValueError:
        return {}
    return holder if isinstance(holder, dict) else {}


def _describe(holder: dict) -> str:
    if not holder:
        return "holder unknown"
    gone = holder.get("host") == socket.gethostname() and not _alive(holder.get("pid"))
    return f"pid {holder.get('pid')} on host {holder.get('host')}, started {holder.get('started')}" + (
        ", no longer running" if gone else ""
    )


def _alive(pid) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by another user
        return True
    return True
