"""An off-device table: the ``StemTable`` lookup protocol over host or disk rows, with an optional
hot-row cache on the compute device and consumption of rows prefetched in the background.

Protocol (shared with ``stemlm.tables.StemTable``; the sparse optimizer relies on it):
``lookup(ids) -> ids.shape + (dim,)``, ``num_rows``, ``dim``, ``sparse_grad``,
``pop_touched() -> [(unique_ids, rows_leaf)]``, ``read_rows(ids)``, ``write_rows(ids, rows)``.

The table also takes part in ``state_dict``/``load_state_dict`` under the same key as an
in-memory table (``tables.<layer>.weight``), so ``checkpoint.save_model`` writes a normal
checkpoint whatever the tier (the tensor it hands out is the backing tensor itself: for the disk
tier a memory-mapped view, read chunk by chunk only when saved).
"""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn

from ..tables import check_ids, expand_rows, unique_ids
from .cache import HotRowCache


@dataclass
class TableStats:
    """Traffic counters of one table (rows/bytes moved = read from the backing store)."""

    lookups: int = 0
    unique_rows: int = 0
    rows_moved: int = 0
    bytes_moved: int = 0
    prefetched: int = 0  # lookups served by a prefetch
    stalls: int = 0  # ... of which had to wait for it
    stall_seconds: float = 0.0  # ... in total
    rows_written: int = 0

    def as_dict(self) -> dict:
        return asdict(self)


class OffloadedTable(nn.Module):
    """Rows in ``backend`` (``HostRows``/``DiskRows``), served on ``device`` as ``dtype``."""

    def __init__(self, backend, device=None, dtype: torch.dtype | None = None, cache: HotRowCache | None = None):
        super().__init__()
        self.backend = backend
        self.num_rows, self.dim = backend.shape
        self.device = torch.device(device or "cpu")
        self.dtype = dtype or backend.dtype
        self.cache = cache
        self.sparse_grad = False
        self.touched: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.stats = TableStats()
        self.name = ""  # the layer key in model.tables, set by the store
        self.prefetcher = None  # set by the store when prefetch is on
        self.store = None  # the TableStore handle that installed this table
        self._lock = threading.Lock()  # the prefetch worker and the caller share cache and counters

    # -- reading ---------------------------------------------------------------------------
    def gather_unique(self, uniq: torch.Tensor) -> torch.Tensor:
        """Rows ``(U, dim)`` on the compute device for unique ids (through the cache if any)."""
        uniq = uniq.to("cpu")
        with self._lock:
            if self.cache is not None:
                return self.cache.fetch(uniq, self._load)
            return self._load(uniq)

    def advise(self, uniq: torch.Tensor) -> None:
        """Let the backing store start reading the rows of ``uniq`` the cache does not hold.

        The prefetch worker calls it for layers ahead of the one it gathers, without their table
        lock: the cache lookup may be stale, which costs at most a needless or a missing hint,
        never a wrong row. Host rows need no hint: nothing is done for them."""
        if not self.backend.reads_ahead:
            return
        uniq = uniq.to("cpu")
        if self.cache is not None:
            uniq = uniq[self.cache.slot_of[uniq] < 0]
        self.backend.advise(uniq)

    def _load(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.backend.gather(ids)  # (n, dim) on CPU
        self.stats.rows_moved += len(ids)
        self.stats.bytes_moved += rows.numel() * rows.element_size()
        if self.device.type == "cuda":  # pinned staging (caching host allocator) -> async copy
            return rows.pin_memory().to(self.device, self.dtype, non_blocking=True)
        return rows.to(self.device, self.dtype)

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows for ``ids`` (any shape) -> ``ids.shape + (dim,)``, using a matching prefetch if issued."""
        got = self.prefetcher.take(self, ids) if self.prefetcher is not None else None
        if got is not None:
            uniq, inverse, rows = got
        else:
            check_ids(ids, self.num_rows)
            uniq, inverse = unique_ids(ids)
            rows = self.gather_unique(uniq)
        with self._lock:
            self.stats.lookups += 1
            self.stats.unique_rows += len(uniq)
        if self.sparse_grad and torch.is_grad_enabled():
            rows = rows.detach().requires_grad_(True)  # (U, dim) leaf: the gradient stays row-sparse
            self.touched.append((uniq, rows))
        return expand_rows(rows, inverse.to(rows.device), ids.shape)

    def pop_touched(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The ``(unique_ids, rows_leaf)`` pairs recorded since the last call."""
        out, self.touched = self.touched, []
        return out

    def read_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Copy of the rows at ``ids`` on the compute device (no autograd, no cache traffic)."""
        ids = torch.as_tensor(ids, dtype=torch.long)
        check_ids(ids, self.num_rows)
        with self._lock:
            return self.backend.gather(ids.to("cpu").flatten()).to(self.device, self.dtype).view(*ids.shape, self.dim)

    # -- writing ---------------------------------------------------------------------------
    @torch.no_grad()
    def write_rows(self, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """Overwrite rows at unique ``ids``: backing store and cache together (write-through)."""
        ids = torch.as_tensor(ids, dtype=torch.long).flatten().to("cpu")
        check_ids(ids, self.num_rows)
        rows = rows.detach().reshape(len(ids), self.dim)
        with self._lock:
            self.backend.scatter(ids, rows)
            if self.cache is not None:
                self.cache.update(ids, rows)
            self.stats.rows_written += len(ids)
        if self.prefetcher is not None:
            self.prefetcher.invalidate(self)  # rows gathered before this write are stale

    def flush(self) -> None:
        """Make written rows durable (disk tier)."""
        with self._lock:
            self.backend.flush()

    # -- checkpoints -----------------------------------------------------------------------
    def _save_to_state_dict(self, destination, prefix, keep_vars):
        destination[prefix + "weight"] = self.backend.weight  # the backing tensor itself, not a copy

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        key = prefix + "weight"
        if key not in state_dict:
            missing_keys.append(key)
            return
        src = state_dict[key]
        if tuple(src.shape) != (self.num_rows, self.dim):
            error_msgs.append(f"size mismatch for {key}: copying {tuple(src.shape)} into a table of "
                              f"{(self.num_rows, self.dim)}")
            return
        chunk = max(1, (64 << 20) // max(1, self.dim * src.element_size()))
        for a in range(0, self.num_rows, chunk):
            b = min(self.num_rows, a + chunk)
            self.write_rows(torch.arange(a, b), src[a:b])

    def extra_repr(self) -> str:
        cache = f", cache={self.cache.capacity} rows" if self.cache is not None else ""
        return (f"{self.num_rows}, {self.dim}, {self.backend.describe()} -> {self.device}/{self.dtype}{cache}, "
                f"sparse_grad={self.sparse_grad}")
