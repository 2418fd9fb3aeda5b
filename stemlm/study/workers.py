"""Several processes training one study side by side.

Each ``stemlm study run`` process takes a run only after creating its claim file
(``<scratch>/claims/<run dir name>.claim``, created exclusively, holding the host and pid), so any
number of processes on one results/scratch pair cooperate: none trains a run another is training.
A claim whose process is gone (same host, pid not alive) is stale and taken over. ``--jobs N``
starts N such processes at ``cores // N`` threads each: on small models two one-thread processes
train nearly twice as many steps per second as one two-thread process.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path


class RunClaims:
    """Claim files in ``scratch/claims``: who is training which run."""

    def __init__(self, scratch: str | Path):
        self.dir = Path(scratch) / "claims"
        self.host, self.pid = socket.gethostname(), os.getpid()

    def path(self, key: str) -> Path:
        return self.dir / f"{key}.claim"

    def holder(self, key: str) -> dict | None:
        """The live process that claimed ``key`` ({host, pid}), or None (unclaimed, or its process is gone)."""
        path = self.path(key)
        try:
            owner = json.loads(path.read_text())
        except FileNotFoundError:
            return None
        except json.JSONDecodeError:  # being written (for an instant), or left empty by a crash long ago
            try:
                fresh = time.time() - path.stat().st_mtime < 60
            except FileNotFoundError:
                return None
            return {"host": "?", "pid": 0} if fresh else None
        if owner.get("host") == self.host and not _alive(int(owner.get("pid", -1))):
            return None
        return owner

    def take(self, key: str) -> bool:
        """Claim ``key`` for this process; False if another live process holds it."""
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.path(key)
        for _ in range(2):
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                owner = self.holder(key)
                if owner is not None:
                    return owner == {"host": self.host, "pid": self.pid}
                path.unlink(missing_ok=True)  # stale: its process is gone
                continue
            with os.fdopen(fd, "w") as f:
                json.dump({"host": self.host, "pid": self.pid}, f)
            return True
        return False

    def release(self, key: str) -> None:
        """Drop this process's claim on ``key``."""
        if self.holder(key) == {"host": self.host, "pid": self.pid}:
            self.path(key).unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def run_workers(argv: list[str], jobs: int, log=print) -> None:
    """Run ``stemlm <argv>`` (one study worker) in ``jobs`` processes at once, ``cores // jobs``
    torch threads each (unless OMP_NUM_THREADS is set), and wait for all of them.

    Raises RuntimeError naming the first worker that failed."""
    threads = os.environ.get("OMP_NUM_THREADS") or str(max(1, (os.cpu_count() or 1) // jobs))
    env = {**os.environ, "OMP_NUM_THREADS": threads}
    log(f"{jobs} workers, {threads} thread(s) each")
    procs = [subprocess.Popen([sys.executable, "-m", "stemlm", *argv], env=env) for _ in range(jobs)]
    codes = [p.wait() for p in procs]
    failed = [i for i, c in enumerate(codes) if c != 0]
    if failed:
        raise RuntimeError(f"study worker {failed[0] + 1} of {jobs} exited with status {codes[failed[0]]}")
