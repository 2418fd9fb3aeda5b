"""Measurements kept between processes: one JSON file per key under ``$STEMLM_CACHE/<kind>/``.

What a run measures before it starts (``run.matmul=auto``'s GEMM choice, convert's per-layer costs) is the same
every time for the same inputs, so it is measured once and read back: the same machine then makes the same
choice, hence the same losses, and a resumed or repeated command does not pay again. The cache is only ever a
shortcut: an absent, unreadable or damaged file, or one written for another key, is measured again and
rewritten, never an error; a read-only cache keeps the value for this process only.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from typing import TypeVar

from .artifacts import cache_dir
from .files import atomic_write_text

T = TypeVar("T")


def cached_json(kind: str, key: str, compute: Callable[[], T], valid: Callable[[object], bool] = lambda v: True
                ) -> tuple[T, bool]:
    """``(value, cached)``: the value stored for exactly ``key`` under ``$STEMLM_CACHE/<kind>/`` if ``valid``
    accepts it (``cached=True``), else ``compute()`` (JSON-serialisable), stored atomically beside its key."""
    path = cache_dir() / kind / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.json"
    try:
        saved = json.loads(path.read_text())
        if isinstance(saved, dict) and saved.get("key") == key and valid(saved.get("value")):
            return saved["value"], True
    except (OSError, ValueError):
        pass  # absent or damaged: measure (again)
    value = compute()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps({"key": key, "value": value}, indent=1))
    except OSError:
        pass
    return value, False
