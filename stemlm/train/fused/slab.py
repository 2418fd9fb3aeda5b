"""``SlabTables``: host-RAM tables trained through a fixed device slab, so the step can be captured.

``HostTables`` rebuilds its device window every step at the size of the step's distinct ids, which a
CUDA graph cannot replay; its steps run uncaptured, and on one H200 that alone made them 0.53× the
captured all-on-GPU step (docs/gpu.md, third lease). Here the device holds a *slab* of ``C`` slots at
fixed addresses (rows, moments, counters: ``(n, C + 1, d)`` and ``(n, C + 1)``) and a fixed map
``slab_of (V,)`` from id to slot:

1. ``prepare_step(ids)`` (host, before the step; not captured) makes every id of the step resident:
   the ids the slab lacks take free slots, then the slots least recently used by earlier steps; a
   victim updated since it was loaded is written back to host RAM first. Rows move on the compute
   stream, ordered with the steps before and after (on CUDA the device reads and writes the pinned
   host rows itself, ``stemlm.runtime.uva``; on the CPU they are plain copies), and ``slab_of`` is
   rewritten in place;
2. the step itself (``begin_step`` … the optimizer; capturable) is ``FusedTables``'s with the slab as its
   stacked rows and the ids translated to slots: dedup over slots with static shapes, the gather, the
   kernels, the masked row AdamW. Padded slots (slots the step does not use) read and write the extra
   slot ``C``, so a masked write-back never lands on a live row;
3. ``flush()`` writes every updated slot back to host RAM (checkpoints, evaluation, ``state_dict``).

Host RAM is the rows' home: the tables' parameters and the optimizer state that checkpoints read live
there. A slab of ``C ≥ V`` slots holds every row, and after the first steps nothing crosses the bus
until a flush. Movement is not overlapped with compute (the first version): a step waits for its rows.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.nn as nn

from ...model.tables import LayerRows, StemTable, check_ids
from ...runtime.uva import device_view
from .dedup import Dedup, dedup
from .host import rows_from_home, stem_tables_of
from .mover import Mover, to_device_async
from .stacked import FusedTables, StepRows, assert_on_device

STATE_PARTS = ("exp_avg", "exp_avg_sq", "step", "last_step")


class SlabTables(FusedTables):
    """All tables stacked in (pinned) host RAM, trained through a fixed device slab (module docstring)."""

    tier = "host"
    prepares_steps = True

    def __init__(self, tables: Mapping[str, StemTable], device, capacity: int, kernels: str = "torch",
                 cache_ids: torch.Tensor | None = None, uva: bool | None = None):
        """``capacity``: slots on the device (at most the number of rows; a step's distinct ids plus the
        cached ones must fit). ``cache_ids``: rows that stay resident once loaded (the hot-row cache).
        ``uva``: the device reads and writes host RAM itself (default on CUDA when a view can be made)."""
        for t in tables.values():
            t.weight.data = t.weight.data.to("cpu")
        super().__init__(tables, exact=False, kernels=kernels)
        self.compute = torch.device(device)
        self.mover = Mover(self.compute)
        home = self.storage.pin_memory() if self.mover.cuda else self.storage
        for i, t in enumerate(self.values()):
            t.weight = nn.Parameter(home[i])
        self.home = home  # (n, V, d): the rows' home in host RAM
        n, V, d = home.shape
        if not 0 < capacity:
            raise ValueError(f"the device slab needs at least one slot, got {capacity}")
        C = self.capacity = min(int(capacity), V)
        self.cache_ids = (torch.unique(cache_ids.to("cpu", torch.long)) if cache_ids is not None
                          else torch.zeros(0, dtype=torch.long))
        check_ids(self.cache_ids, V)
        if len(self.cache_ids) >= C and C < V:
            raise ValueError(f"the hot-row cache ({len(self.cache_ids)} rows) fills the device slab ({C} slots)")
        z = lambda *shape, dt=torch.float32: torch.zeros(shape, dtype=dt, device=self.compute)  # noqa: E731
        self.storage = z(n, C + 1, d)  # the slab's rows; slot C takes the padded slots' reads and writes
        self.slab_state = {"exp_avg": z(n, C + 1, d), "exp_avg_sq": z(n, C + 1, d),
                           "step": z(n, C + 1, dt=torch.int64), "last_step": z(n, C + 1, dt=torch.int64)}
        self.slab_of = torch.full((V,), C, dtype=torch.long, device=self.compute)  # id -> slot (C: not held)
        self.uva = self.mover.cuda if uva is None else uva
        self._views: list[torch.Tensor] | None = None  # _home_parts as the device reads them (UVA)
        self._reset_slab()
        self.traffic = {"rows_in": 0, "rows_out": 0}
        self.register_state_dict_pre_hook(lambda module, prefix, keep_vars: module.flush())
        self.register_load_state_dict_post_hook(lambda module, keys: module._reload_rows())

    @property
    def device(self) -> torch.device:
        return self.compute

    def _reset_slab(self) -> None:
        """Forget what the slab holds (host bookkeeping and the device map); the next steps load afresh."""
        C, V = self.capacity, self.num_rows
        self.held = torch.full((C,), -1, dtype=torch.long)  # slot -> id (-1: free)
        self.slot_of = torch.full((V,), -1, dtype=torch.long)  # id -> slot (-1: not held)
        self.used_at = torch.full((C,), -1, dtype=torch.long)  # the prepared step that last used each slot
        self.dirty = torch.zeros(C, dtype=torch.bool)  # updated since it was loaded
        self.prepared = 0
        self.slab_of.fill_(C)

    # -- the rows' home ----------------------------------------------------------------------
    def zeros(self, shape, dtype: torch.dtype) -> torch.Tensor:
        return self.mover.host_empty(shape, dtype).zero_()

    def optim_state(self) -> dict[str, torch.Tensor]:
        """The optimizer state's home, beside the rows in host RAM (what checkpoints read, after ``flush``)."""
        if self._state is None:
            n, V, d = self.home.shape
            self._state = {"exp_avg": self.zeros((n, V, d), torch.float32),
                           "exp_avg_sq": self.zeros((n, V, d), torch.float32),
                           "step": self.zeros((n, V), torch.int64), "last_step": self.zeros((n, V), torch.int64)}
        return self._state

    def _home_parts(self) -> list[torch.Tensor]:
        return [self.home] + [self.optim_state()[k] for k in STATE_PARTS]

    def _slab_parts(self) -> list[torch.Tensor]:
        return [self.storage] + [self.slab_state[k] for k in STATE_PARTS]

    def _views_of_home(self) -> list[torch.Tensor] | None:
        """The home tensors as the device reads and writes them in place (UVA), or None (copies)."""
        if not self.uva:
            return None
        if self._views is None:
            views = [device_view(t, self.compute) for t in self._home_parts()]
            if any(v is None for v in views):
                self.uva = False
                return None
            self._views = views
        return self._views

    def _load(self, slots: torch.Tensor, ids: torch.Tensor) -> None:
        """Home rows ``ids`` (with their state) into slab ``slots`` (host index tensors), on the compute stream."""
        self._copy(slots, ids, into_slab=True)
        self.traffic["rows_in"] += len(ids)

    def _store(self, slots: torch.Tensor, ids: torch.Tensor) -> None:
        """Slab ``slots`` back into home rows ``ids``, ordered after the work queued so far."""
        self._copy(slots, ids, into_slab=False)
        self.traffic["rows_out"] += len(ids)

    def _copy(self, slots: torch.Tensor, ids: torch.Tensor, into_slab: bool) -> None:
        """Every part between slab ``slots`` and home rows ``ids``: the device reads or writes host RAM itself
        (UVA) or, on the CPU, in place; else through copies (home written once they landed: a host wait)."""
        dev_slots = to_device_async(slots, self.compute)
        views = self._views_of_home()
        direct = views is not None or not self.mover.cuda
        home = views or self._home_parts()
        dev_ids = to_device_async(ids, self.compute) if direct else None
        for part, rows in zip(self._slab_parts(), home):
            if into_slab:
                src = rows.index_select(1, dev_ids) if direct else to_device_async(rows.index_select(1, ids),
                                                                                     self.compute)
                part.index_copy_(1, dev_slots, src)
            elif direct:
                rows.index_copy_(1, dev_ids, part.index_select(1, dev_slots))
            else:
                rows.index_copy_(1, ids, part.index_select(1, dev_slots).cpu())

    # -- before a step (host; not captured) ------------------------------------------------------
    def prepare_step(self, ids: Sequence[torch.Tensor], ticket=None) -> None:
        """Make every id of the coming step resident in the slab (module docstring, 1.); ``ticket``: unused."""
        flat = torch.cat([i.reshape(-1).to("cpu") for i in ids])
        check_ids(flat, self.num_rows)
        step_ids = torch.unique(flat)
        need = torch.unique(torch.cat([step_ids, self.cache_ids]))
        C = self.capacity
        if len(need) > C:
            raise ValueError(f"a step uses {len(need)} distinct table rows (hot-row cache included) but the device "
                             f"slab has {C} slots (raise run.table_slab_rows)")
        held = self.slot_of.index_select(0, need)  # (-1: not in the slab)
        missing = need[held < 0]
        if len(missing):
            in_step = torch.zeros(C, dtype=torch.bool)
            in_step[held[held >= 0]] = True
            free = (self.held < 0).nonzero()[:, 0]
            busy = ((self.held >= 0) & ~in_step).nonzero()[:, 0]
            if len(self.cache_ids):  # cached rows stay once loaded
                busy = busy[~torch.isin(self.held[busy], self.cache_ids)]
            busy = busy[torch.argsort(self.used_at[busy], stable=True)]  # least recently used first
            slots = torch.cat([free, busy])[:len(missing)]
            victims = slots[self.held[slots] >= 0]
            write = victims[self.dirty[victims]]
            if len(write):
                self._store(write, self.held[write])
            if len(victims):
                old = self.held[victims]
                self.slot_of[old] = -1
                self.slab_of.index_fill_(0, to_device_async(old, self.compute), C)
            self._load(slots, missing)
            self.held[slots] = missing
            self.slot_of[missing] = slots
            self.dirty[slots] = False
            self.slab_of.index_copy_(0, to_device_async(missing, self.compute), to_device_async(slots, self.compute))
        step_slots = self.slot_of.index_select(0, step_ids)
        self.used_at[step_slots] = self.prepared
        self.dirty[step_slots] = True  # the step's update changes them
        self.prepared += 1

    # -- the step (capturable) -----------------------------------------------------------------
    def begin_step(self, ids: Sequence[torch.Tensor], ticket=None) -> StepRows:
        """The step's rows from the slab: the ids (resident since ``prepare_step``) translated to slots,
        deduplicated with static shapes over the slots."""
        flat = torch.cat([i.reshape(-1).to(ids[0].device) for i in ids])
        check_ids(flat, self.num_rows)
        keys = self.step_keys(to_device_async(flat, self.compute))
        assert_on_device((keys < self.capacity).all(), "a step used table rows prepare_step did not load")
        d = dedup(keys, self.capacity, exact=False)
        self.step_rows = self.open_step(d, self.load_rows(d))
        return self.step_rows

    def step_keys(self, ids: torch.Tensor) -> torch.Tensor:
        return self.slab_of.index_select(0, ids.reshape(-1)).view(ids.shape)

    def rows(self, ids: torch.Tensor) -> LayerRows:
        if torch.is_grad_enabled() and self.step_rows is None:
            self.prepare_step([ids])  # a forward without begin_step: its rows are loaded now
        return super().rows(ids)

    def slots(self, d: Dedup) -> torch.Tensor:
        """The step's slab slots; padded slots go to the spare slot ``C`` (read and written, never a live row)."""
        valid = d.valid()
        return d.uniq if valid is None else torch.where(valid, d.uniq, self.capacity)

    def update_target(self) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return self.storage, self.slab_state

    # -- checkpoints, evaluation -------------------------------------------------------------------
    def flush(self) -> None:
        """Write every slot updated since it was loaded back to host RAM, and wait for it."""
        write = self.dirty.nonzero()[:, 0]
        if len(write):
            self._store(write, self.held[write])
            self.dirty[write] = False
        if self.mover.cuda:
            torch.cuda.current_stream(self.compute).synchronize()  # the host reads host RAM next

    def _reload_rows(self) -> None:
        """The home rows were replaced (``load_state_dict``): the slab's rows follow (their moments stay)."""
        slots = (self.held >= 0).nonzero()[:, 0]
        if len(slots):
            rows = self.home.index_select(1, self.held[slots])
            self.storage.index_copy_(1, to_device_async(slots, self.compute), to_device_async(rows, self.compute))

    def state_loaded(self) -> None:
        """The home state was replaced (a resume): the slab is emptied and refilled from home."""
        self._reset_slab()
        self._views = None

    def _rows_no_grad(self, ids: torch.Tensor) -> LayerRows:
        self.flush()
        return rows_from_home(self, self.home, ids)


def install_slab_tables(model: nn.Module, device, capacity: int, kernels: str = "torch",
                        cache_ids: torch.Tensor | None = None) -> SlabTables:
    """Move ``model.tables`` (in-memory ``StemTable``s) into one ``SlabTables``; returns it."""
    model.tables = SlabTables(stem_tables_of(model), device, capacity, kernels, cache_ids)
    return model.tables
