"""One writer per run directory: an advisory ``fcntl.flock`` on ``<run.out>/train.lock``.

The lock belongs to an open file, so the kernel drops it when its process dies, even by
``kill -9``: a lock is never stale in the kernel's eyes. The file also holds the pid of its holder
(emptied on a clean release), so a pid found in it by the next trainer names a process that died
while training; it is reported and the lock taken over. A live holder makes ``RunLocked`` name
its pid. All ranks of a torchrun job share the run dir: only the rank that writes takes the lock.
"""

from __future__ import annotations

import fcntl
import os
import warnings
import weakref
from pathlib import Path

LOCK_FILE = "train.lock"


class RunLocked(FileExistsError):
    """Another live process is training into the same run directory."""


class RunLock:
    """Holds ``<run_dir>/train.lock`` until ``release()`` (or until the object is collected)."""

    def __init__(self, run_dir: str | os.PathLike):
        self.path = Path(run_dir) / LOCK_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_pid(fd)
            os.close(fd)
            who = f"pid {holder}" if holder else "another process"
            raise RunLocked(f"run dir {self.path.parent} is in use by a training in {who}; wait for it to finish "
                            "or choose another run.out") from None
        self.stale_pid = _read_pid(fd)
        if self.stale_pid:
            warnings.warn(f"{self.path}: taking over the lock of pid {self.stale_pid}, which died while training",
                          stacklevel=2)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd
        self._finalizer = weakref.finalize(self, _unlock, fd)

    def release(self) -> None:
        """Empty the pid file and drop the lock (idempotent)."""
        self._finalizer()

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _read_pid(fd: int) -> int | None:
    try:
        return int(os.pread(fd, 32, 0).decode().strip() or 0) or None
    except (ValueError, OSError):
        return None


def _unlock(fd: int) -> None:
    try:
        os.ftruncate(fd, 0)
    finally:
        os.close(fd)  # closing the file drops the flock
