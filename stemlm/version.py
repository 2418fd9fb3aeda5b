"""The version of stemlm and, when it runs from a git checkout, the commit (``stemlm --version``)."""

from __future__ import annotations

import subprocess
from pathlib import Path

from . import __version__


def git_commit(path: str | Path | None = None) -> str | None:
    """Short commit of the checkout holding ``path`` (default: this package), plus ``-dirty`` when
    tracked files changed; None outside a git checkout or without git."""
    where = Path(path) if path is not None else Path(__file__).resolve().parent
    try:
        def git(*args):
            return subprocess.run(["git", "-C", str(where), *args], capture_output=True, text=True, timeout=5)

        head = git("rev-parse", "--short=12", "HEAD")
        if head.returncode != 0:
            return None
        dirty = git("status", "--porcelain", "--untracked-files=no").stdout.strip()
        return head.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


def version_string() -> str:
    """``stemlm 0.1.0 (git 1a2b3c4d5e6f)``; the commit part only when it is known."""
    commit = git_commit()
    return f"stemlm {__version__}" + (f" (git {commit})" if commit else "")
