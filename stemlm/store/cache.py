"""A hot-row cache on the compute device with least-frequently-used (LFU) replacement.

Frequencies are counted for *every* row id ever requested, resident or not ("perfect" LFU), so a
row that keeps coming back earns its place even after it was first turned away. One request is
one unique id in one lookup (positions of the same id in a batch are deduplicated before the
cache sees them, and one transfer serves them all).

Replacement, for the rows that missed in a lookup:

1. free slots go to the missed rows with the highest counts (ties: smaller id first);
2. once full, a missed row replaces a resident row only if its count is *strictly* higher;
   victims are taken in order of (count, last use, id) ascending, i.e. LFU with an LRU
   tie-break, and rows used by the current lookup are never evicted by it.

Admission window (off by default; ``window`` = a fraction of the capacity, W-TinyLFU of Einziger
et al. 2017): a missed row always enters a small LRU *window* segment, so a row that recurs a few
tokens later (a topic word in the current document) is a hit even before it has a high count.
When the window overflows, its least recently used rows become candidates for the *main*
segment: a candidate replaces the coldest main row only if its count is strictly higher,
otherwise it is dropped. The main segment is the LFU cache above. With ``window=0`` the cache is
plain LFU (rules 1-2). On the real corpus at 10 % of rows a 10 % window raises the warm-started
hit rate by 3-6 points (``benchmarks/bench_cache_hit.py``).

Aging (off by default): with ``decay_every = n``, every ``n`` lookups all counts are halved, so
rows that were hot long ago lose their advantage over rows that are hot now.

Warm start: ``warm(counts, load)`` sets the counts (e.g. ``train.counts.npy``, the token
frequencies of the training split) and fills the cache with the most frequent rows. With counts
that large, online requests barely change the ranking: the cache then behaves as a static
top-k cache unless ``decay_every`` lets recent traffic take over.

The cache holds values, not ownership: the table writes every change through to the backing
store *and* into the cache (``update``), so both always agree.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch


class HotRowCache:
    """``capacity`` rows of a ``(num_rows, dim)`` table kept on ``device`` (see module docstring)."""

    def __init__(self, num_rows: int, dim: int, capacity: int, device=None, dtype: torch.dtype = torch.float32,
                 decay_every: int = 0, window: float = 0.0):
        if capacity < 1:
            raise ValueError(f"cache capacity must be at least one row, got {capacity}")
        if not 0.0 <= window < 1.0:
            raise ValueError(f"cache window must be a fraction of the capacity in [0, 1), got {window}")
        self.num_rows, self.dim, self.capacity = num_rows, dim, min(capacity, num_rows)
        self.decay_every = decay_every
        self.window_rows = round(window * self.capacity) if window else 0
        self.in_window = torch.zeros(self.capacity, dtype=torch.bool)  # slot -> belongs to the LRU window
        self.slots = torch.zeros(self.capacity, dim, device=device, dtype=dtype)  # (C, dim)
        self.slot_of = torch.full((num_rows,), -1, dtype=torch.long)  # row id -> slot, -1 = not cached
        self.id_of = torch.full((self.capacity,), -1, dtype=torch.long)  # slot -> row id, -1 = free
        self.freq = torch.zeros(num_rows, dtype=torch.long)
        self.last_used = torch.zeros(num_rows, dtype=torch.long)
        self.clock = 0
        self.hits = self.misses = self.evictions = self.inserts = 0

    # -- lookups --------------------------------------------------------------------------
    def fetch(self, uniq: torch.Tensor, load: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """Rows ``(U, dim)`` for unique CPU ids: hits from the cache, misses via ``load(ids)``."""
        self.clock += 1
        self.freq[uniq] += 1
        self.last_used[uniq] = self.clock
        slots = self.slot_of[uniq]
        hit = slots >= 0
        n_hit = int(hit.sum())
        self.hits += n_hit
        self.misses += len(uniq) - n_hit
        out = torch.empty(len(uniq), self.dim, device=self.slots.device, dtype=self.slots.dtype)
        dev_hit = hit.to(out.device)
        if n_hit:
            out[dev_hit] = self.slots[slots[hit].to(out.device)]
        if n_hit < len(uniq):
            miss_ids = uniq[~hit]
            rows = load(miss_ids).to(out.device, out.dtype)  # (M, dim)
            out[~dev_hit] = rows
            if self.window_rows:
                self._admit_to_window(miss_ids, rows)
            else:
                self._admit(miss_ids, rows)
        if self.decay_every and self.clock % self.decay_every == 0:
            self.freq >>= 1
        return out

    def _admit(self, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """Place missed rows into free slots, then replace colder residents (see module docstring)."""
        order = torch.sort(self.freq[ids], descending=True, stable=True).indices  # hottest first
        ids, rows = ids[order], rows[order.to(rows.device)]
        free = (self.id_of < 0).nonzero().flatten()
        n_free = min(len(free), len(ids))
        if n_free:
            self._place(free[:n_free], ids[:n_free], rows[:n_free])
        ids, rows = ids[n_free:], rows[n_free:]
        if len(ids) == 0:
            return
        victims = self._victims()
        m = min(len(ids), len(victims))
        better = self.freq[ids[:m]] > self.freq[victims[:m]]  # hot-desc vs cold-asc: True on a prefix
        k = int(better.long().cumprod(0).sum())
        if k:
            victim_slots = self.slot_of[victims[:k]]
            self.slot_of[victims[:k]] = -1
            self.evictions += k
            self._place(victim_slots, ids[:k], rows[:k])

    def _admit_to_window(self, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """Missed rows enter the LRU window; its overflow competes for the main segment (see module docstring)."""
        ids, rows = ids[-self.window_rows:], rows[-self.window_rows:]  # a lookup larger than the window keeps its tail
        free = (self.id_of < 0).nonzero().flatten()
        win_slots = (self.in_window & (self.id_of >= 0)).nonzero().flatten()
        overflow = len(win_slots) + len(ids) - self.window_rows
        if overflow > 0:  # the oldest window rows leave the window
            oldest = win_slots[torch.sort(self.last_used[self.id_of[win_slots]], stable=True).indices[:overflow]]
            free = torch.cat([free, self._promote(oldest)])
        # main holds at most capacity - window_rows rows, so enough slots are free now
        slots = free[:len(ids)]
        self.in_window[slots] = True
        self._place(slots, ids, rows)

    def _promote(self, slots: torch.Tensor) -> torch.Tensor:
        """Window rows at ``slots`` move to main while it has room, then each must beat main's
        coldest row by count or leave; returns the slots this frees."""
        cand = self.id_of[slots]
        order = torch.sort(self.freq[cand], descending=True, stable=True).indices  # hottest first
        slots, cand = slots[order], cand[order]
        n_main = int((~self.in_window & (self.id_of >= 0)).sum())
        room = max(0, min(len(slots), self.capacity - self.window_rows - n_main))
        self.in_window[slots[:room]] = False  # relabelled, no copy
        slots, cand = slots[room:], cand[room:]
        victims = self._victims(main_only=True)
        m = min(len(cand), len(victims))
        k = int((self.freq[cand[:m]] > self.freq[victims[:m]]).long().cumprod(0).sum())
        victim_slots = self.slot_of[victims[:k]]
        self.in_window[slots[:k]] = False  # winners join main in place; the rows they beat leave
        self.slot_of[victims[:k]] = -1
        self.slot_of[cand[k:]] = -1  # losers leave
        freed = torch.cat([victim_slots, slots[k:]])
        self.id_of[freed] = -1
        self.in_window[freed] = False
        self.evictions += len(freed)
        return freed

    def _victims(self, main_only: bool = False) -> torch.Tensor:
        """Resident ids not used by the current lookup, coldest first: (count, last use, id)."""
        resident = self.id_of[(self.id_of >= 0) & ~self.in_window] if main_only else self.id_of[self.id_of >= 0]
        resident = resident[self.last_used[resident] != self.clock]
        resident = resident[torch.sort(resident, stable=True).indices]
        resident = resident[torch.sort(self.last_used[resident], stable=True).indices]
        return resident[torch.sort(self.freq[resident], stable=True).indices]

    def _place(self, slots: torch.Tensor, ids: torch.Tensor, rows: torch.Tensor) -> None:
        self.slots[slots.to(self.slots.device)] = rows.to(self.slots.dtype)
        self.slot_of[ids] = slots
        self.id_of[slots] = ids
        self.inserts += len(ids)

    # -- coherence and warm start ---------------------------------------------------------
    def update(self, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """Write-through: refresh the cached copies of ``ids`` (unique CPU ids) with ``rows``."""
        slots = self.slot_of[ids]
        cached = slots >= 0
        if cached.any():
            self.slots[slots[cached].to(self.slots.device)] = rows[cached.to(rows.device)].to(self.slots.device, self.slots.dtype)

    def warm(self, counts, load: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Set the counts to ``counts`` (length ``num_rows``) and fill the cache with the top rows."""
        counts = torch.as_tensor(np.asarray(counts), dtype=torch.long).flatten()
        if len(counts) != self.num_rows:
            raise ValueError(f"warm-start counts have {len(counts)} entries, the table has {self.num_rows} rows")
        self.freq.copy_(counts)
        self.slot_of.fill_(-1)
        self.id_of.fill_(-1)
        top = torch.sort(counts, descending=True, stable=True).indices[:self.capacity]
        top = top[counts[top] > 0]  # hottest first: main gets the head, the window the rest
        in_window = torch.arange(len(top)) >= self.capacity - self.window_rows
        by_id = torch.sort(top).indices  # rows are loaded in id order
        top = top[by_id]
        self.in_window.zero_()
        self.in_window[:len(top)] = in_window[by_id]
        if len(top):
            self._place(torch.arange(len(top)), top, load(top))
            self.inserts -= len(top)  # warm-up is not traffic

    def resident_ids(self) -> torch.Tensor:
        """Ids currently cached (sorted)."""
        return self.id_of[self.id_of >= 0].sort().values

    def stats(self) -> dict:
        """Hit/miss/eviction counters and occupancy."""
        total = self.hits + self.misses
        return {"capacity_rows": self.capacity, "resident_rows": int((self.id_of >= 0).sum()), "hits": self.hits,
                "misses": self.misses, "hit_rate": self.hits / total if total else 0.0, "evictions": self.evictions,
                "inserts": self.inserts}

    def reset_stats(self) -> None:
        self.hits = self.misses = self.evictions = self.inserts = 0
