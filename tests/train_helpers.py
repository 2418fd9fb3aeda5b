"""Shared by tests/test_train*.py: a tiny learnable synthetic data dir and debug-run configs."""

from pathlib import Path

import numpy as np
import pytest
import torch

from stemlm.data import write_token_split
from stemlm.train import load_train_config

VOCAB = 512


def make_token_data(out: Path, vocab: int = VOCAB, n_train: int = 200, n_val: int = 20, seed: int = 0,
                    used: int = 48) -> Path:
    """Documents that are arithmetic progressions over ids 1..used: learnable in a few steps."""
    rng = np.random.default_rng(seed)

    def docs(n):
        return [(rng.integers(0, used) + np.arange(rng.integers(20, 120)) * rng.integers(1, 3)) % used + 1
                for _ in range(n)]

    write_token_split(out, "train", docs(n_train), vocab, 0)
    write_token_split(out, "val", docs(n_val), vocab, 0)
    return Path(out)


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models gain nothing from threads; one thread avoids oversubscribing a shared machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def debug_config(data_dir: Path, out: Path, *overrides: str):
    """The debug run on ``data_dir`` writing to ``out``: no progress bar, plots or FLOP probe."""
    return load_train_config("debug", None, [f"data.dir={data_dir}", f"run.out={out}", "run.peak_flops=1e11",
                                             "run.progress=false", "run.plots=false", *overrides])


def losses(run_dir: Path, key: str = "loss") -> list:
    import json

    return [json.loads(line).get(key) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
