"""Several processes training one study side by side.

Each ``stemlm study run`` process takes a run only after creating its claim file
(a lock in ``<scratch>/claims/<run dir name>/``), so any number of processes on one results/scratch
pair cooperate: none trains a run another is training; the claim of a process that died is free. ``--jobs N``
starts N such processes at ``cores // N`` threads each: on small models two one-thread processes
train nearly twice as many steps per second as one two-thread process.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from ..train.lock import RunLock, RunLocked


class RunClaims:
    """Claims on runs, one ``train.lock`` (``stemlm.train.lock.RunLock``, an ``flock`` the kernel drops
    when its process dies) per run in ``scratch/claims/<key>/``: exclusive across processes, and a
    dead process's claim is free again without any liveness check."""

    def __init__(self, scratch: str | Path):
        self.dir = Path(scratch) / "claims"
        self.held: dict[str, RunLock] = {}

    def take(self, key: str) -> bool:
        """Claim ``key`` for this process; False if another live process holds it."""
        if key not in self.held:
            try:
                self.held[key] = RunLock(self.dir / key)
            except RunLocked:
                return False
        return True

    def release(self, key: str) -> None:
        """Drop this process's claim on ``key``."""
        if (lock := self.held.pop(key, None)) is not None:
            lock.release()


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
