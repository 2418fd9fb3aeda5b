"""The host and disk tiers: ``OffloadedTable`` (one layer's rows in a backend, behind an optional
hot-row cache) and ``TableStore`` (all of a model's offloaded tables, installed as
``model.tables``, with the prefetcher, the lock and the traffic counters).

A forward gets its rows from the store in one of two ways: ``prefetch(ids)`` returns a ticket (a
``LayerRows`` over the rows a worker gathers in the background) that the caller passes to the
forward of those ids as ``table_rows``; without one, ``TableStore.rows(ids)`` makes the ids unique
once and gathers every layer synchronously when the model reaches it. Tables hold no pointer to their store: the store hands each table its lock
when it builds it, and a write bumps the table's ``version``, which tells the prefetcher that rows
gathered before it are stale.

Tables take part in ``state_dict``/``load_state_dict`` under the same key as an in-memory table
(``tables.<layer>.weight``), so ``checkpoint.save_model`` writes a normal checkpoint whatever the
tier (the tensor handed out is the backing tensor itself: for the disk tier a memory-mapped view,
read chunk by chunk only when saved).
"""

from __future__ import annotations

import threading
from pathlib import Path

import torch
import torch.nn as nn

from ..model.tables import LayerRows, TableLookup, Tables, TableStats, check_ids
from ..runtime.uva import device_view
from .backends import HostRows
from .cache import HotRowCache
from .prefetch import Prefetcher


class OffloadedTable(TableLookup, nn.Module):
    """Rows in ``backend`` (``HostRows``/``DiskRows``), served on ``device`` as ``dtype``.

    ``lock`` guards the backend, the cache and the traffic counters; a ``TableStore`` gives all
    its tables its own lock, shared with its prefetch worker."""

    def __init__(self, backend, device=None, dtype: torch.dtype | None = None, cache: HotRowCache | None = None,
                 lock: threading.Lock | None = None):
        super().__init__()
        self.backend = backend
        self.num_rows, self.dim = backend.shape
        self.device = torch.device(device or "cpu")
        self.dtype = dtype or backend.dtype
        self.cache = cache
        self.sparse_grad = False
        self.stats = TableStats()
        self.version = 0  # bumped by every write: rows gathered before it are stale
        self.lock = lock or threading.Lock()

    # -- reading ---------------------------------------------------------------------------
    def fetch(self, uniq: torch.Tensor) -> torch.Tensor:
        """Rows ``(U, dim)`` on the compute device for unique ids, through the cache if any (no
        autograd, not counted as a lookup; the prefetch worker calls it)."""
        uniq = uniq.to("cpu")
        with self.lock:
            if self.cache is not None:
                return self.cache.fetch(uniq, self._load)
            return self._load(uniq)

    def gather(self, uniq: torch.Tensor, fetched: torch.Tensor | None = None) -> torch.Tensor:
        """Rows ``(U, dim)`` for unique ids: ``fetched`` (rows a prefetch gathered) or read now;
        counted as one lookup (under ``sparse_grad`` the container makes them a recorded leaf)."""
        rows = self.fetch(uniq) if fetched is None else fetched
        self.stats.lookups += 1  # the consuming thread alone counts lookups: no lock needed
        self.stats.unique_rows += len(uniq)
        return rows

    def advise(self, uniq: torch.Tensor) -> None:
        """Let the backing store start reading the rows of ``uniq`` the cache does not hold.

        The prefetch worker calls it for layers ahead of the one it gathers, without the lock:
        the cache lookup may be stale, which costs at most a needless or a missing hint, never a
        wrong row. Host rows need no hint: nothing is done for them."""
        if not self.backend.reads_ahead:
            return
        uniq = uniq.to("cpu")
        if self.cache is not None:
            uniq = uniq[self.cache.slot_of[uniq] < 0]
        self.backend.advise(uniq)

    def _load(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.backend.gather(ids)  # (n, dim) on CPU, decoded if the backend is quantized
        self.stats.rows_moved += len(ids)
        self.stats.bytes_moved += len(ids) * self.backend.row_bytes
        if self.device.type == "cuda":  # pinned staging (caching host allocator) -> async copy
            return rows.pin_memory().to(self.device, self.dtype, non_blocking=True)
        return rows.to(self.device, self.dtype)

    def warm(self, counts) -> None:
        """Fill the cache with the most frequent rows of ``counts`` (not counted as traffic)."""
        with self.lock:
            self.cache.warm(counts, self._load)
            self.stats = TableStats()

    def read_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Copy of the rows at ``ids`` on the compute device (no autograd, no cache traffic)."""
        ids = torch.as_tensor(ids, dtype=torch.long)
        check_ids(ids, self.num_rows)
        with self.lock:
            return self.backend.gather(ids.to("cpu").flatten()).to(self.device, self.dtype).view(*ids.shape, self.dim)

    # -- writing ---------------------------------------------------------------------------
    @torch.no_grad()
    def write_rows(self, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """Overwrite rows at unique ``ids``: backing store and cache together (write-through)."""
        ids = torch.as_tensor(ids, dtype=torch.long).flatten().to("cpu")
        check_ids(ids, self.num_rows)
        rows = rows.detach().reshape(len(ids), self.dim)
        with self.lock:
            self.backend.scatter(ids, rows)
            if self.cache is not None:
                self.cache.update(ids, rows)
            self.stats.rows_written += len(ids)
            self.version += 1

    def flush(self) -> None:
        """Make written rows durable (disk tier)."""
        with self.lock:
            self.backend.flush()

    def close(self) -> None:
        """Close the backend (a disk file); the table is unusable afterwards."""
        with self.lock:
            self.backend.close()

    # -- checkpoints -----------------------------------------------------------------------
    def _save_to_state_dict(self, destination, prefix, keep_vars):
        for name, tensor in self.backend.state_tensors().items():  # the backing tensors themselves, not copies
            destination[prefix + name] = tensor

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        key = prefix + "weight"
        if key not in state_dict:
            missing_keys.append(key)
            return
        src, codec = state_dict[key], getattr(self.backend, "codec", None)
        expected = self.backend.state_tensors()["weight"].shape
        if tuple(src.shape) != tuple(expected):
            error_msgs.append(f"size mismatch for {key}: copying {tuple(src.shape)} into a table of {tuple(expected)}")
            return
        if codec is not None and codec.has_scale and prefix + "scale" not in state_dict:
            missing_keys.append(prefix + "scale")
            return
        scale = state_dict.get(prefix + "scale") if codec is not None else None
        chunk = max(1, (64 << 20) // max(1, self.dim * 4))
        for a in range(0, self.num_rows, chunk):
            b = min(self.num_rows, a + chunk)
            rows = src[a:b] if codec is None else codec.decode(src[a:b], None if scale is None else scale[a:b], self.dim)
            self.write_rows(torch.arange(a, b), rows)  # re-encoding decoded rows gives the same codes

    def extra_repr(self) -> str:
        cache = f", cache={self.cache.capacity} rows" if self.cache is not None else ""
        return (f"{self.num_rows}, {self.dim}, {self.backend.describe()} -> {self.device}/{self.dtype}{cache}, "
                f"sparse_grad={self.sparse_grad}")


class TableStore(Tables):
    """All offloaded tables of a model (``host`` or ``disk`` tier), installed as ``model.tables``.

    Built from ``backends`` (layer key -> ``HostRows``/``DiskRows``) and ``caches`` (layer key ->
    ``HotRowCache`` or None); with ``prefetch`` a ``Prefetcher`` worker gathers rows ahead of the
    forward. Also a context manager that closes the store.
    """

    def __init__(self, tier: str, backends: dict, caches: dict[str, HotRowCache | None], device=None,
                 dtype: torch.dtype | None = None, prefetch: bool = True, path: Path | None = None):
        super().__init__()
        self.tier, self.path = tier, path
        self.lock = threading.Lock()
        for key in sorted(backends, key=int):  # layer order: the prefetcher gathers in it
            self[key] = OffloadedTable(backends[key], device, dtype, caches.get(key), self.lock)
        self.prefetcher = Prefetcher(dict(self.items()), device) if prefetch and len(self) else None


    def _take_layer(self, job, key: str) -> torch.Tensor:
        """One layer's rows of a prefetch job (gathered again if a write made them stale)."""
        table, got = self[key], self.prefetcher.wait(job, key)
        if got is None:
            rows = table.gather(job.uniq)
        else:
            fetched, stall_seconds = got
            table.stats.prefetched += 1
            table.stats.stalls += int(stall_seconds is not None)
            table.stats.stall_seconds += stall_seconds or 0.0
            rows = table.gather(job.uniq, fetched)
        return self.track(key, table, job.uniq, rows)

    def prefetch(self, ids: torch.Tensor) -> LayerRows | None:
        """Start gathering the rows of ``ids`` for every layer; returns the ticket to pass to the forward of
        those ids (``model(ids, table_rows=ticket)``), or None without a prefetch worker (the forward then
        gathers). A layer a write made stale is gathered again when the forward reaches it."""
        if self.prefetcher is None:
            return None
        job = self.prefetcher.prefetch(ids)
        return LayerRows({k: (lambda k=k: self._take_layer(job, k)) for k in self.keys()}, job.inverse, job.shape)

    def device_views(self, device) -> dict[str, torch.Tensor] | None:
        """Every layer's rows as a tensor ``device`` reads in place (``stemlm.runtime.uva``: pinned host
        RAM seen by CUDA kernels; the host tensor itself on the CPU), or None when the tier or the
        stored form does not allow it (disk, quantized rows, unpinned memory). Lookups through the
        views bypass the hot-row cache and the traffic counters; writes through ``write_rows`` are seen."""
        if self.tier != "host":
            return None
        views = {}
        for key, table in self.items():
            backend = table.backend
            view = device_view(backend.weight, device) if isinstance(backend, HostRows) else None
            if view is None:
                return None
            views[key] = view
        return views

    def stats(self) -> dict:
        """Totals and per-layer traffic counters, plus cache counters when a cache is on."""
        per = {k: t.stats.as_dict() for k, t in self.items()}
        totals = {f: sum(p[f] for p in per.values()) for f in TableStats().as_dict()}
        out = {"tier": self.tier, "tables": len(self), "prefetch": self.prefetcher is not None, **totals}
        caches = {k: t.cache.stats() for k, t in self.items() if t.cache is not None}
        if caches:
            cache = {f: sum(c[f] for c in caches.values()) for f in ("capacity_rows", "resident_rows", "hits",
                                                                         "misses", "evictions", "inserts")}
            seen = cache["hits"] + cache["misses"]
            out["cache"] = {**cache, "hit_rate": cache["hits"] / seen if seen else 0.0}
        out["per_table"] = {k: {**per[k], **({"cache": caches[k]} if k in caches else {})} for k in per}
        return out

    def reset_stats(self) -> None:
        """Zero every counter (e.g. after a warm-up)."""
        with self.lock:
            for t in self.values():
                t.stats = TableStats()
                if t.cache is not None:
                    t.cache.reset_stats()

    def flush(self) -> None:
        """Make written rows durable (disk tier)."""
        for t in self.values():
            t.flush()

    def close(self) -> None:
        """Stop the prefetch worker, flush, and close every backend (disk files); idempotent.

        The tables are unusable afterwards: install them again to keep serving.
        """
        if self.prefetcher is not None:
            self.prefetcher.close()
            self.prefetcher = None
        for t in self.values():
            t.close()
