"""``HostTables``: training with the tables and their optimizer state in host RAM.

The accelerator holds the backbone and a *window*: the rows, moments and counters of the current
step's distinct ids (``(n, U, d)``), plus the staged rows of the next step. ``get_batch`` is a
pure function of the step, so the trainer knows the next step's ids and the pipeline is:

1. ``begin_step(ids)`` (step s) builds the window: rows the previous window also holds are taken
   from it on the device (they were just updated there: the host copy may be stale), the others
   from what ``prefetch_step`` staged; rows of the previous window that step s does not use are
   *evicted*: gathered on the device and copied to host buffers on a side stream;
2. forward and backward of step s run on the compute stream;
3. ``prefetch_step(next_ids)`` (called once backward is queued, while it runs): the evictions
   of the previous step have landed by now; they are scattered into host RAM, then the rows step
   s+1 needs and the window does not hold are gathered into pinned buffers and copied to the
   device on the side stream;
4. the optimizer updates the window in place (``FusedRowAdamW.update_window``).

Rows stay on the device as long as consecutive steps use them; every row reaches the host before
it is read from there again. ``flush()`` writes the window back (checkpoints, evaluation).
On the CPU the copies are synchronous clones (``mover.py``): the same code runs in the tests.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn

from ...model.tables import LayerRows, StemTable, check_ids
from .dedup import Dedup, dedup
from ...runtime.uva import device_view
from .mover import Mover, to_device_async
from .stacked import FusedTables, StepRows

PARTS = ("rows", "m", "v", "step", "last")  # what travels with a row
STATE_OF = {"m": "exp_avg", "v": "exp_avg_sq", "step": "step", "last": "last_step"}


@dataclass
class Window:
    """A step's rows on the device: ``ids`` (host, ``(U,)``: the step's ids ascending, then cached rows it
    does not use), ``slot_of`` (host, ``(V,)``),
    ``count``, and per part a device tensor ``(n, U, d)`` (rows, m, v) or ``(n, U)`` (counters)."""

    ids: torch.Tensor
    slot_of: torch.Tensor
    parts: dict[str, torch.Tensor]
    dirty: bool = False  # holds updates host RAM does not have yet

    def __getattr__(self, name):  # win.rows, win.m, ... (dataclass fields are found first)
        try:
            return self.__dict__["parts"][name]
        except KeyError:
            raise AttributeError(name) from None

    def holds(self, ids: torch.Tensor) -> torch.Tensor:
        """``(len(ids),)`` bool: which of ``ids`` this window holds."""
        return self.slot_of.index_select(0, ids) < len(self.ids)


@dataclass
class Staged:
    """Rows of a coming step copied towards the device: for its ids ``ids``, the window ``base``
    it was planned against, positions taken from ``base`` (``carry_pos`` <- ``carry_src``) and
    from the copies (``fresh_pos``)."""

    ids: torch.Tensor
    base: Window | None
    carry_pos: torch.Tensor
    carry_src: torch.Tensor
    fresh_pos: torch.Tensor
    parts: list[torch.Tensor]
    host: list[torch.Tensor]
    event: object
    generation: int = 0  # HostTables.generation when staged: host rows replaced since make it stale


class HostTables(FusedTables):
    """All tables stacked in (pinned) host RAM, trained through a device window (module docstring)."""

    def __init__(self, tables: Mapping[str, StemTable], device, kernels: str = "torch", uva: bool | None = None,
                 cache_ids: torch.Tensor | None = None):
        """``uva``: the device reads and writes host RAM itself (``stemlm.runtime.uva``; the default on
        CUDA when a view of the pinned rows can be made); False: rows are gathered on the host and copied.
        ``cache_ids``: rows kept on the device in every window (the hot-row cache, ``run.table_cache_rows``):
        they never cross the bus once loaded; a step that does not use one leaves it unchanged (a masked
        update, as padded slots)."""
        for t in tables.values():
            t.weight.data = t.weight.data.to("cpu")
        super().__init__(tables, exact=True, kernels=kernels)
        self.compute = torch.device(device)
        self.mover = Mover(self.compute)
        if self.mover.cuda:
            self.storage = self.storage.pin_memory()
            for i, t in enumerate(self.values()):
                t.weight = nn.Parameter(self.storage[i])
        self.uva = self.mover.cuda if uva is None else uva
        self.cache_ids = (torch.unique(cache_ids.to("cpu", torch.long)) if cache_ids is not None
                          else torch.zeros(0, dtype=torch.long))
        check_ids(self.cache_ids, self.num_rows)
        self._views: dict[str, torch.Tensor] | None = None
        self.window: Window | None = None
        self.generation = 0  # bumped when host rows are replaced (load_state_dict): older tickets are stale
        self.pending: list[tuple[torch.Tensor, list[torch.Tensor], object]] = []  # evictions in flight
        self.traffic = {"rows_in": 0, "rows_out": 0}
        # model.state_dict() reads host RAM: write the window back first; model.load_state_dict()
        # replaced the rows there: refresh the window's rows (its moments stay)
        self.register_state_dict_pre_hook(lambda module, prefix, keep_vars: module.flush())
        self.register_load_state_dict_post_hook(lambda module, keys: module._reload_rows())

    tier = "host"

    @property
    def device(self) -> torch.device:
        return self.compute

    def zeros(self, shape, dtype: torch.dtype) -> torch.Tensor:
        return self.mover.host_empty(shape, dtype).zero_()

    # -- a step -----------------------------------------------------------------------------
    def begin_step(self, ids: Sequence[torch.Tensor], ticket: Staged | None = None) -> StepRows:
        """Build the window of the coming step from the previous one and what ``prefetch_step`` staged
        for exactly these ids (its ``ticket``); without a ticket, or one planned against another
        window, everything is written back and loaded afresh."""
        flat = torch.cat([i.reshape(-1).to("cpu") for i in ids])
        check_ids(flat, self.num_rows)
        d = self._window_dedup(dedup(flat, self.num_rows, exact=True))  # on the host: free
        staged = ticket
        if staged is None or staged.base is not self.window or staged.generation != self.generation:
            self.flush()  # not planned: write everything back, load everything
            self.window = None
            staged = self._stage(d.uniq)
        self.window = self._assemble(d, staged)
        put = lambda t: to_device_async(t, self.compute)  # noqa: E731
        dev = Dedup(put(d.uniq), put(d.count), put(d.slot_of), padded=d.padded)
        self.step_rows = self.open_step(dev, self.window.rows)
        return self.step_rows

    def _window_dedup(self, d: Dedup) -> Dedup:
        """The window of a step with distinct ids ``d``: its ids in slots ``[0, count)``, then the cached
        rows it does not use (padded slots: no gradient, no update); ``slot_of`` of other ids is past the end."""
        if not len(self.cache_ids):
            return d
        extra = self.cache_ids[~torch.isin(self.cache_ids, d.uniq)]
        ids = torch.cat([d.uniq, extra])
        slot_of = torch.full((self.num_rows,), len(ids), dtype=torch.long)
        slot_of[ids] = torch.arange(len(ids))
        return Dedup(ids, d.count, slot_of, padded=bool(len(extra)))

    def prefetch_step(self, ids: Sequence[torch.Tensor]) -> Staged:
        """Stage the rows of the next step (call while the current step computes); returns the ticket
        to pass to that step's ``begin_step``."""
        flat = torch.cat([i.reshape(-1).to("cpu") for i in ids])
        check_ids(flat, self.num_rows)
        return self._stage(self._window_dedup(dedup(flat, self.num_rows, exact=True)).uniq)

    def _stage(self, uniq: torch.Tensor) -> Staged:
        """Plan the window of ``uniq`` against the current one and copy the rows it lacks."""
        self._land_evictions()  # every row read from host RAM below is current there
        base = self.window
        held = base.holds(uniq) if base is not None else torch.zeros(len(uniq), dtype=torch.bool)
        carry_pos, fresh_pos = held.nonzero()[:, 0], (~held).nonzero()[:, 0]
        carry_src = base.slot_of.index_select(0, uniq[carry_pos]) if base is not None else carry_pos
        fresh = uniq[fresh_pos]
        views = self.views()
        if views is not None:  # the device gathers the rows from host RAM itself, on the side stream
            host = []
            parts, event = self.mover.gather_views([views[p] for p in PARTS], fresh)
        else:
            host = [self._gather_host(part, fresh) for part in PARTS]
            parts, event = self.mover.to_device(host)
        self.traffic["rows_in"] += len(fresh)
        return Staged(uniq, base, carry_pos, carry_src, fresh_pos, parts, host, event, self.generation)

    def _gather_host(self, part: str, ids: torch.Tensor) -> torch.Tensor:
        src = self._host(part)
        out = self.mover.host_empty((src.shape[0], len(ids), *src.shape[2:]), src.dtype)
        return torch.index_select(src, 1, ids, out=out)  # (n, F, ...)

    def _host(self, part: str) -> torch.Tensor:
        """The host-RAM tensor of one part (rows, or a piece of optimizer state)."""
        return self.storage if part == "rows" else self.optim_state()[STATE_OF[part]]

    def views(self) -> dict[str, torch.Tensor] | None:
        """Every part's host tensor as the compute device reads it in place (UVA), or None."""
        if not self.uva:
            return None
        if self._views is None:
            views = {part: device_view(self._host(part), self.compute) for part in PARTS}
            if any(v is None for v in views.values()):
                self.uva = False  # no view could be made (e.g. memory not pinned): copy as before
                return None
            self._views = views
        return self._views

    def _assemble(self, d: Dedup, staged: Staged) -> Window:
        """The window of ``d``: carried rows from the current window, fresh ones from ``staged``;
        the current window's other rows are evicted."""
        self.mover.ready(staged.parts, staged.event)
        old, to = self.window, lambda t: to_device_async(t, self.compute)  # noqa: E731
        carry_pos, carry_src, fresh_pos = to(staged.carry_pos), to(staged.carry_src), to(staged.fresh_pos)
        parts = {}
        for name, fresh in zip(PARTS, staged.parts):
            out = torch.empty((fresh.shape[0], len(d.uniq), *fresh.shape[2:]), dtype=fresh.dtype, device=self.compute)
            out.index_copy_(1, fresh_pos, fresh)
            if old is not None:
                out.index_copy_(1, carry_pos, old.parts[name].detach().index_select(1, carry_src))
            parts[name] = out
        if old is not None and old.dirty:
            kept = torch.zeros(len(old.ids), dtype=torch.bool)
            kept[staged.carry_src] = True
            self._evict(old, (~kept).nonzero()[:, 0])
        return Window(d.uniq, d.slot_of, parts, dirty=old is not None and old.dirty and len(staged.carry_pos) > 0)

    def _evict(self, win: Window, pos: torch.Tensor) -> None:
        """Start copying the rows of ``win`` at positions ``pos`` back to host RAM."""
        if len(pos) == 0:
            return
        idx = to_device_async(pos, self.compute)
        rows = [win.parts[p].detach().index_select(1, idx) for p in PARTS]
        views = self.views()
        if views is not None:  # the device writes them into host RAM itself, after the step's update
            event = self.mover.scatter_views([views[p] for p in PARTS], win.ids[pos], rows)
            self.pending.append((None, None, event))
        else:
            host, event = self.mover.to_host(rows)
            self.pending.append((win.ids[pos], host, event))
        self.traffic["rows_out"] += len(pos)

    def _land_evictions(self) -> None:
        """Scatter the evicted rows that were copied back into host RAM. Rows the device wrote into host
        RAM itself (UVA) need nothing here: the side stream runs every later gather after them."""
        for ids, host, event in self.pending:
            if ids is None:
                continue
            Mover.wait(event)
            for part, rows in zip(PARTS, host):
                self._host(part).index_copy_(1, ids, rows)
        self.pending = []

    # -- the optimizer, checkpoints, evaluation ---------------------------------------------
    def apply_update(self, opt, step: StepRows) -> None:
        """Update the window in place (every slot holds an id of the step)."""
        opt.update_window(step.rows.detach(), step.grad, self.window, step.dedup.valid())
        self.window.dirty = True

    def flush(self) -> None:
        """Write the window's updated rows back to host RAM and wait for them (a host sync)."""
        if self.window is not None and self.window.dirty:
            self._evict(self.window, torch.arange(len(self.window.ids)))
            self.window.dirty = False
        for _, _, event in self.pending:  # the host reads host RAM next: every write must have landed
            Mover.wait(event)
        self._land_evictions()
        self.pending = []

    def _reload_rows(self) -> None:
        self._land_evictions()
        self.generation += 1
        if self.window is not None:
            rows = self.storage.index_select(1, self.window.ids).to(self.compute)
            self.window.parts["rows"].data.copy_(rows)

    def state_loaded(self) -> None:
        """The host state was replaced (a resume): forget the window, anything in flight and the views
        (a ticket staged before is then planned against another window: ``begin_step`` ignores it)."""
        self.window, self.pending, self._views = None, [], None

    def _rows_no_grad(self, ids: torch.Tensor) -> LayerRows:
        self.flush()
        return rows_from_home(self, self.storage, ids)


def rows_from_home(tables: FusedTables, home: torch.Tensor, ids: torch.Tensor) -> LayerRows:
    """Every layer's rows for ``ids`` read from host RAM ``home (n, V, d)`` (no gradient; the caller flushed),
    on the tables' compute device."""
    host_ids = ids.to("cpu")
    check_ids(host_ids, tables.num_rows)
    d = dedup(host_ids, tables.num_rows, exact=True)
    per_table = home.index_select(1, d.uniq).to(tables.device).unbind(0)
    inverse = d.inverse(host_ids).to(tables.device)
    return LayerRows({k: (lambda r=r: r) for k, r in zip(tables.keys(), per_table)}, inverse, ids.shape)


def install_host_tables(model: nn.Module, device, kernels: str = "torch", uva: bool | None = None,
                        cache_ids: torch.Tensor | None = None) -> HostTables:
    """Move ``model.tables`` (in-memory ``StemTable``s) into one ``HostTables``; returns it."""
    model.tables = HostTables(stem_tables_of(model), device, kernels, uva, cache_ids)
    return model.tables


def stem_tables_of(model: nn.Module) -> dict[str, StemTable]:
    """``model.tables`` as a dict, or a one-line ``ValueError`` unless they are in-memory ``StemTable``s."""
    tables = dict(model.tables.items())
    if not tables or not all(type(t) is StemTable for t in tables.values()):
        raise ValueError("host-tier training needs the model's tables in memory as StemTables")
    return tables
