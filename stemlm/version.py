"""The version of stemlm and, when it runs from a git checkout, the commit (``stemlm --version``)."""

from __future__ import annotations

import subprocess
from pathlib import Path

from . import __version__


def _git(where: str | Path | None, *args: str) -> str | None:
    """Stripped output of ``git -C WHERE ARGS`` (default: this package's checkout), or None when git
    is missing or fails (not a checkout)."""
    where = Path(where) if where is not None else Path(__file__).resolve().parent
    try:
        out = subprocess.run(["git", "-C", str(where), *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def git_head(path: str | Path | None = None, short: bool = False) -> str | None:
    """Commit of the checkout holding ``path`` (full, or 12 hex digits with ``short``); None outside one."""
    return _git(path, "rev-parse", *(["--short=12"] if short else []), "HEAD") or None


def code_dirty(path: str | Path | None = None, outputs: tuple[str, ...] = ("results", "benchmarks/results")) -> bool:
    """True when tracked files of the checkout holding ``path`` differ from its commit outside the result
    folders ``outputs`` (relative to the checkout's root): results a run writes do not make the code dirty."""
    spec = [":(top)", *(f":(top,exclude){o}" for o in outputs)]
    return bool(_git(path, "status", "--porcelain", "--untracked-files=no", "--", *spec))


def untracked(path: str | Path, *under: str) -> list[str]:
    """Untracked, not ignored files of the checkout holding ``path``, below the folders ``under`` (relative
    to the checkout's root)."""
    spec = [f":(top){u}" for u in under] + [":(top,exclude)benchmarks/results"]
    out = _git(path, "ls-files", "--others", "--exclude-standard", "--full-name", "--", *spec)
    return out.splitlines() if out else []


def git_commit(path: str | Path | None = None) -> str | None:
    """Short commit of the checkout holding ``path`` (default: this package), plus ``-dirty`` when
    tracked files changed outside the result folders (``code_dirty``: a benchmark that merges its entries
    into a committed JSON file stays clean); None outside a git checkout or without git."""
    head = git_head(path, short=True)
    return head and head + ("-dirty" if code_dirty(path) else "")


def version_string() -> str:
    """``stemlm 0.1.0 (git 1a2b3c4d5e6f)``; the commit part only when it is known."""
    commit = git_commit()
    return f"stemlm {__version__}" + (f" (git {commit})" if commit else "")
