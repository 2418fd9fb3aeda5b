"""Per-request results on disk, so an interrupted evaluation continues where it stopped.

``CachedLM`` wraps any ``LanguageModel``: each request is looked up in a SQLite file of that
model's own (named by a hash of ``identity``, which is also stored in the file and checked), and
only the missing ones go to the model, ``batch_size`` at a time, each batch committed as soon as it
is answered. Two models never share a file, and a file whose recorded identity differs is refused,
so results of different weights cannot mix. A tqdm bar with ETA counts the requests.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sqlite3
from collections.abc import Callable, Sequence
from pathlib import Path

from tqdm import tqdm

from .api import GenerateRequest, LanguageModel, Loglikelihood, LoglikelihoodRequest


def request_key(kind: str, request) -> str:
    """Stable key of one request: sha256 of its kind and fields."""
    fields = dataclasses.asdict(request) if dataclasses.is_dataclass(request) else {"text": request}
    blob = json.dumps([kind, fields], sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


class ResultCache:
    """A SQLite key/value file of one model's answers."""

    def __init__(self, path: Path, identity: str):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(str(self.path))
        self.db.execute("CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT)")
        self.db.execute("CREATE TABLE IF NOT EXISTS results (key TEXT PRIMARY KEY, value TEXT)")
        row = self.db.execute("SELECT value FROM meta WHERE key='identity'").fetchone()
        if row is None:
            self.db.execute("INSERT INTO meta VALUES ('identity', ?)", (identity,))
            self.db.commit()
        elif row[0] != identity:
            raise ValueError(f"result cache {self.path} belongs to model {row[0]!r}, not {identity!r}; "
                             "delete it or pass another --cache-dir")

    def get_many(self, keys: Sequence[str]) -> dict[str, object]:
        """Cached values of those ``keys`` that have one."""
        found: dict[str, object] = {}
        unique = list(dict.fromkeys(keys))
        for i in range(0, len(unique), 500):  # SQLite limits the number of bound parameters
            chunk = unique[i:i + 500]
            marks = ",".join("?" * len(chunk))
            for key, value in self.db.execute(f"SELECT key, value FROM results WHERE key IN ({marks})", chunk):
                found[key] = json.loads(value)
        return found

    def put_many(self, items: dict[str, object]) -> None:
        """Store and commit answers."""
        self.db.executemany("INSERT OR REPLACE INTO results VALUES (?, ?)",
                            [(k, json.dumps(v)) for k, v in items.items()])
        self.db.commit()

    def close(self) -> None:
        """Close the file."""
        self.db.close()


def cache_path(cache_dir: Path, identity: str) -> Path:
    """The cache file of the model ``identity`` under ``cache_dir``."""
    return Path(cache_dir) / f"{hashlib.sha256(identity.encode()).hexdigest()[:32]}.sqlite"


class CachedLM:
    """A ``LanguageModel`` answering from the cache first (see the module docstring).

    ``sent`` counts the requests that reached the wrapped model; ``desc`` labels the progress bar.
    """

    def __init__(self, lm: LanguageModel, cache_dir: Path | None, batch_size: int = 64, progress: bool = True):
        if batch_size <= 0:
            raise ValueError(f"--batch-size must be positive, got {batch_size}")
        self.lm, self.batch_size, self.progress = lm, batch_size, progress
        self.identity, self.max_length = lm.identity, lm.max_length
        self.cache = ResultCache(cache_path(cache_dir, lm.identity), lm.identity) if cache_dir is not None else None
        self.sent, self.desc = 0, "eval"

    def _answer(self, kind: str, requests: Sequence, call: Callable[[list], list], encode, decode) -> list:
        keys = [request_key(kind, r) for r in requests]
        done = self.cache.get_many(keys) if self.cache else {}
        todo = {k: r for k, r in zip(keys, requests) if k not in done}  # duplicates asked once
        answers = {k: decode(v) for k, v in done.items()}
        items = list(todo.items())
        with tqdm(total=len(keys), initial=len(keys) - len(items), desc=f"{self.desc} ({kind})", unit="req",
                  disable=not self.progress or not items, leave=False) as bar:
            for i in range(0, len(items), self.batch_size):
                chunk = items[i:i + self.batch_size]
                got = call([r for _, r in chunk])
                self.sent += len(chunk)
                fresh = {k: a for (k, _), a in zip(chunk, got)}
                answers.update(fresh)
                if self.cache:
                    self.cache.put_many({k: encode(a) for k, a in fresh.items()})
                bar.update(len(chunk))
        return [answers[k] for k in keys]

    def loglikelihood(self, requests: Sequence[LoglikelihoodRequest]) -> list[Loglikelihood]:
        """Summed log-prob of each continuation, from the cache or the model."""
        return self._answer("loglikelihood", requests, self.lm.loglikelihood, dataclasses.asdict,
                            lambda v: Loglikelihood(**v))

    def loglikelihood_rolling(self, texts: Sequence[str]) -> list[Loglikelihood]:
        """Log-prob of each whole text, from the cache or the model."""
        return self._answer("rolling", texts, self.lm.loglikelihood_rolling, dataclasses.asdict,
                            lambda v: Loglikelihood(**v))

    def generate_until(self, requests: Sequence[GenerateRequest]) -> list[str]:
        """Greedy continuations, from the cache or the model."""
        return self._answer("generate", requests, self.lm.generate_until, str, str)

    def close(self) -> None:
        """Close the cache file."""
        if self.cache:
            self.cache.close()
