"""Flat token files on disk, opened as memory maps, and deterministic stateless batches.

Layout of one split (``train`` or ``val``) inside a data dir::

    <split>.bin        every document's ids back to back (uint16 if the vocab fits, else uint32)
    <split>.docs.npy   int64 offset of each document's first token (its leading EOS)
    meta.json          shared: vocab_size, dtype, eos_id, n_tokens[split], sha256[<split>.bin], ...

Each document is written as ``[eos, *ids]``: the EOS acts as a separator *and* as the first token
of its document, so with cross-document masking the first real token of a document is still
predicted from something inside its own document. Prompts at inference may start with EOS too.

``get_batch(ds, step, ...)`` is a pure function of ``(seed, step)``: resuming training only
needs the step number, and every rank of a data-parallel run slices the same global batch.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..runtime.artifacts import sha256_of
from ..runtime.files import atomic_file, atomic_write_text

META = "meta.json"
FORMAT_VERSION = 1
# Verify the full sha256 of a bin on open when it is at most this big (larger bins: size checks only,
# so opening a large corpus does not read it whole).
VERIFY_LIMIT_BYTES = 512 << 20


def token_dtype(vocab_size: int) -> np.dtype:
    """Smallest unsigned dtype that holds ids ``0 .. vocab_size-1``."""
    if vocab_size <= 0:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def read_meta(data_dir: Path) -> dict:
    """``meta.json`` of a data dir (clear error if the dir or the file is missing / unreadable)."""
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise FileNotFoundError(f"data dir {data_dir} does not exist; run `stemlm data prepare`")
    path = data_dir / META
    if not path.exists():
        raise FileNotFoundError(f"{data_dir} is not a prepared data dir (no {META}); run `stemlm data prepare`")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON ({e.msg} at line {e.lineno})") from None


def write_meta(data_dir: Path, meta: dict) -> None:
    """Write ``meta.json`` atomically."""
    atomic_write_text(Path(data_dir) / META, json.dumps(meta, indent=2, sort_keys=True) + "\n")


def update_meta(data_dir: Path, **fields) -> dict:
    """Merge ``fields`` into ``meta.json`` (nested dicts are merged one level deep)."""
    path = Path(data_dir) / META
    meta = json.loads(path.read_text()) if path.exists() else {}
    for k, v in fields.items():
        meta[k] = {**meta.get(k, {}), **v} if isinstance(v, dict) and isinstance(meta.get(k), dict) else v
    write_meta(data_dir, meta)
    return meta


def write_token_split(out_dir: Path, split: str, docs: Iterable[np.ndarray], vocab_size: int, eos_id: int) -> int:
    """Write documents (arrays of token ids, without EOS) as ``<split>.bin`` + ``<split>.docs.npy``.

    Each document is stored as ``[eos_id, *doc]``. ``meta.json`` is created or updated with the
    vocab size, dtype, eos id, token count and sha256 of the bin; for the ``train`` split the
    token frequency counts go to ``train.counts.npy``. Files are written to a temporary name and
    renamed, so a crash never leaves a half-written bin under the final name. Returns the number
    of tokens written.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    dtype = token_dtype(vocab_size)
    if not 0 <= eos_id < vocab_size:
        raise ValueError(f"eos_id {eos_id} is outside the vocabulary [0, {vocab_size})")
    starts: list[int] = []
    counts = np.zeros(vocab_size, dtype=np.int64)
    digest = hashlib.sha256()
    n = 0
    with atomic_file(out_dir / f"{split}.bin") as tmp_bin, open(tmp_bin, "wb") as f:
        for i, doc in enumerate(docs):
            ids = np.asarray(doc).ravel()
            if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
                raise ValueError(f"document {i} of split {split!r} has a token id outside [0, {vocab_size})")
            row = np.concatenate([np.array([eos_id], dtype=dtype), ids.astype(dtype)])
            starts.append(n)
            n += row.size
            counts += np.bincount(row, minlength=vocab_size)
            raw = row.tobytes()
            digest.update(raw)
            f.write(raw)
        if not starts:
            raise ValueError(f"split {split!r} has no documents")
    _save_npy(out_dir / f"{split}.docs.npy", np.asarray(starts, dtype=np.int64))
    if split == "train":
        _save_npy(out_dir / "train.counts.npy", counts)
    update_meta(out_dir, version=FORMAT_VERSION, vocab_size=int(vocab_size), dtype=dtype.name,
                eos_id=int(eos_id), n_tokens={split: n}, n_docs={split: len(starts)},
                sha256={f"{split}.bin": digest.hexdigest()})
    return n


def _save_npy(path: Path, array: np.ndarray) -> None:
    with atomic_file(path) as tmp, open(tmp, "wb") as f:
        np.save(f, array)


class TokenDataset:
    """One split of a prepared data dir: memory-mapped token ids plus document start offsets."""

    def __init__(self, path: Path, split: str, tokens: np.ndarray, doc_starts: np.ndarray,
                 vocab_size: int, eos_id: int, meta: dict):
        self.path, self.split, self.meta = Path(path), split, meta
        self.tokens, self.doc_starts = tokens, doc_starts
        self.vocab_size, self.eos_id = int(vocab_size), int(eos_id)
        self.n_tokens = int(tokens.shape[0])

    @property
    def n_docs(self) -> int:
        return int(self.doc_starts.shape[0])

    def __len__(self) -> int:
        return self.n_tokens

    def __repr__(self) -> str:
        return (f"TokenDataset({str(self.path)!r}, split={self.split!r}, n_tokens={self.n_tokens}, "
                f"n_docs={self.n_docs}, vocab_size={self.vocab_size})")

    @classmethod
    def open(cls, data_dir: Path, split: str = "train", verify: bool | None = None) -> "TokenDataset":
        """Open ``<split>.bin`` of ``data_dir`` read-only.

        Checks that the files exist, that the bin size matches ``meta.json`` (dtype and token
        count), the sha256 (``verify=None``: only for bins up to 512 MB; ``True``/``False`` force
        it), that token ids are below the vocab size (with the hash check) and that the document
        offsets are sorted and in range.
        """
        data_dir = Path(data_dir)
        meta = read_meta(data_dir)
        for key in ("vocab_size", "dtype", "eos_id", "n_tokens"):
            if key not in meta:
                raise ValueError(f"{data_dir / META} lacks {key!r}; the data dir is incomplete, prepare it again")
        if split not in meta["n_tokens"]:
            raise ValueError(f"{data_dir} has no split {split!r}; available: {', '.join(sorted(meta['n_tokens']))}")
        dtype, expected = np.dtype(meta["dtype"]), int(meta["n_tokens"][split])
        bin_path, docs_path = data_dir / f"{split}.bin", data_dir / f"{split}.docs.npy"
        for p in (bin_path, docs_path):
            if not p.exists():
                raise FileNotFoundError(f"{p} is missing; prepare the data dir again (`stemlm data prepare --force`)")
        size = bin_path.stat().st_size
        if size % dtype.itemsize or size // dtype.itemsize != expected:
            raise ValueError(f"{bin_path} is truncated or corrupt: {size} bytes, expected {expected} "
                             f"{dtype.name} tokens ({expected * dtype.itemsize} bytes)")
        if verify is None:
            verify = size <= VERIFY_LIMIT_BYTES
        want = meta.get("sha256", {}).get(bin_path.name)
        if verify and want and sha256_of(bin_path) != want:
            raise ValueError(f"{bin_path} does not match the sha256 in meta.json (corrupt or modified)")
        tokens = np.memmap(bin_path, dtype=dtype, mode="r", shape=(expected,))
        if verify and int(tokens.max()) >= int(meta["vocab_size"]):
            raise ValueError(f"{bin_path} holds token id {int(tokens.max())} >= vocab_size {meta['vocab_size']}")
        doc_starts = _load_doc_starts(docs_path, expected)
        return cls(data_dir, split, tokens, doc_starts, meta["vocab_size"], meta["eos_id"], meta)


def _load_doc_starts(path: Path, n_tokens: int) -> np.ndarray:
    try:
        starts = np.load(path, allow_pickle=False)
    except (ValueError, OSError) as e:
        raise ValueError(f"{path} is not a readable .npy file ({e})") from None
    if starts.ndim != 1 or starts.size == 0 or starts[0] != 0:
        raise ValueError(f"{path} must be a non-empty 1-D array of offsets starting at 0")
    if np.any(np.diff(starts) <= 0) or starts[-1] >= n_tokens:
        raise ValueError(f"{path} offsets must be strictly increasing and below n_tokens={n_tokens}")
    return starts.astype(np.int64)


@dataclass
class Batch:
    """Inputs and next-token targets of one (rank's slice of a) batch."""

    inputs: torch.Tensor   # (B, T) int64
    targets: torch.Tensor  # (B, T) int64
    doc_ids: torch.Tensor  # (B, T) int64: index of the document within the row, 0 at the row start

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "Batch":
        """The same batch on ``device``."""
        return Batch(*(t.to(device, non_blocking=non_blocking) for t in (self.inputs, self.targets, self.doc_ids)))

    def pin_memory(self) -> "Batch":
        """The same batch in pinned host memory (so ``to(cuda, non_blocking=True)`` does not wait)."""
        return Batch(*(t.pin_memory() for t in (self.inputs, self.targets, self.doc_ids)))


def batch_offsets(n_tokens: int, step: int, batch_size: int, seq_len: int, seed: int = 0) -> np.ndarray:
    """Start offsets of the global batch of ``step``: uniform over all windows of seq_len+1 tokens."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if batch_size <= 0 or seq_len <= 0:
        raise ValueError(f"batch_size and seq_len must be positive, got {batch_size} and {seq_len}")
    if seq_len + 1 > n_tokens:
        raise ValueError(f"seq_len {seq_len} needs {seq_len + 1} tokens but the split has only {n_tokens}")
    # A fresh generator per (seed, step): no state to carry, identical on every rank and on resume.
    rng = np.random.default_rng([int(seed), int(step)])
    return rng.integers(0, n_tokens - seq_len, size=batch_size, dtype=np.int64)


def rows_at(ds: TokenDataset, offsets: np.ndarray, seq_len: int) -> Batch:
    """The batch made of the windows ``tokens[o : o+seq_len+1]`` for each offset ``o``."""
    idx = offsets[:, None] + np.arange(seq_len + 1, dtype=np.int64)  # (B, T+1)
    window = np.asarray(ds.tokens[idx], dtype=np.int64)  # (B, T+1)
    if window.size and int(window.max()) >= ds.vocab_size:
        raise ValueError(f"{ds.path / (ds.split + '.bin')} holds token id {int(window.max())} >= vocab_size {ds.vocab_size}")
    # Document index of every input position, relative to the document at the row start.
    doc = np.searchsorted(ds.doc_starts, idx[:, :-1], side="right") - 1  # (B, T)
    doc -= doc[:, :1]
    return Batch(torch.from_numpy(window[:, :-1].copy()), torch.from_numpy(window[:, 1:].copy()), torch.from_numpy(doc))


def get_batch(ds: TokenDataset, step: int, batch_size: int, seq_len: int, seed: int = 0,
              rank: int = 0, world_size: int = 1) -> Batch:
    """The batch of global step ``step``: deterministic and stateless.

    The global batch holds ``batch_size`` windows of ``seq_len + 1`` tokens at offsets drawn from a
    generator seeded with ``(seed, step)``; rank ``r`` of ``world_size`` gets rows
    ``[r * B / W, (r + 1) * B / W)``, so the ranks' slices concatenate to the global batch.
    """
    if world_size <= 0 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
    if batch_size % world_size:
        raise ValueError(f"batch_size {batch_size} is not divisible by world_size {world_size}")
    offsets = batch_offsets(ds.n_tokens, step, batch_size, seq_len, seed)
    per_rank = batch_size // world_size
    return rows_at(ds, offsets[rank * per_rank:(rank + 1) * per_rank], seq_len)


def count_eval_batches(ds: TokenDataset, batch_size: int, seq_len: int) -> int:
    """How many batches ``iter_eval_batches`` yields from ``ds`` without a limit."""
    windows = max(0, -(-(ds.n_tokens - seq_len) // seq_len))  # ceil: starts 0, L, 2L, ... < n_tokens - L
    return -(-windows // batch_size)


def iter_eval_batches(ds: TokenDataset, batch_size: int, seq_len: int, max_batches: int | None = None) -> Iterator[Batch]:
    """Consecutive non-overlapping windows from the start of the split (for evaluation).

    Every token except the very first is a target exactly once (up to the last partial window,
    which is dropped); the last batch may have fewer than ``batch_size`` rows.
    """
    if seq_len + 1 > ds.n_tokens:
        raise ValueError(f"seq_len {seq_len} needs {seq_len + 1} tokens but the split has only {ds.n_tokens}")
    starts = np.arange(0, ds.n_tokens - seq_len, seq_len, dtype=np.int64)
    for i, b in enumerate(range(0, len(starts), batch_size)):
        if max_batches is not None and i >= max_batches:
            return
        yield rows_at(ds, starts[b:b + batch_size], seq_len)
