"""Token-indexed STEM tables and ``Tables``, the container of all tables of a model.

A table maps token ids to rows of width ``d_ff``. The model never asks a single table: its
``forward`` calls ``self.tables.rows(ids)`` once, which makes the ids unique *once* for every
layer and returns a ``LayerRows`` mapping (layer key -> rows ``ids.shape + (d_ff,)``) that the
model passes into its blocks (or the caller passes its own mapping as ``table_rows``).

Every tier implements the same two levels:

* a table (``StemTable`` here; ``OffloadedTable`` for host/disk, ``ShardedTable`` across ranks):
  ``index(ids) -> (unique_ids, inverse)``, ``gather(unique_ids) -> (U, dim)`` (differentiable in
  the parameter without ``sparse_grad``; plain rows with it), ``own_grad(unique_ids, leaf)`` (the
  ``(row ids, gradient)`` a row-sparse optimizer applies to this table), ``lookup(ids)`` for one
  table alone, ``read_rows``/``write_rows``, ``num_rows``, ``dim``;
* a container (``Tables`` here, for tables in the model's memory; ``stemlm.store.TableStore`` for
  host/disk; ``stemlm.train.fused`` for the fused path), installed as ``model.tables``: ``rows(ids)``,
  ``prefetch(ids)``, ``begin_step(ids, ticket)``/``prefetch_step(ids)``/``take_step()`` (a training
  step's rows and their gradients, handed to the optimizer), ``stats()``, ``reset_stats()``,
  ``flush()``, ``close()``. State-dict keys stay ``tables.<layer>.weight``.

Gradients of tables under ``sparse_grad`` are handed over explicitly: the container makes each
layer's gathered rows ``(U, dim)`` a fresh leaf and keeps it in the step's ``TouchedRows``; after
backward the optimizer takes that record with ``take_step()`` (``SparseRowAdamW.collect``), as the
fused path's optimizer takes its ``StepRows``. No table keeps gradients of its own.

Lookups deduplicate: each unique row is gathered once and scattered back to every position
(``expand_rows``).
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..ffn.rows import as_rows

# ``unique_ids`` marks rows in a mask instead of sorting for a batch of at least PRESENCE_MIN_IDS ids in a table
# of at most PRESENCE_ROWS_PER_ID rows per id: a smaller batch sorts faster than the mask is cleared and read
PRESENCE_MIN_IDS = 2048
PRESENCE_ROWS_PER_ID = 8


def unique_ids(ids: torch.Tensor, num_rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted unique ids of a batch and, for every position, the index of its unique id
    (``torch.unique(..., sorted=True, return_inverse=True)``, exactly).

    With ``num_rows`` (the ids are known to lie in ``[0, num_rows)``) and a table not much larger than the
    batch, a presence mask over the rows replaces the sort: mark the ids, read the marked rows in order,
    number them. The same two tensors; for a training step's ids on CPU 2–18x faster (4,096 ids of 4,096 rows:
    39 against 235 µs; n-gram keys, 20,480 of 4,096 rows: 70 against 1,281 µs)."""
    flat = ids.reshape(-1)
    if num_rows is None or flat.numel() < PRESENCE_MIN_IDS or num_rows > PRESENCE_ROWS_PER_ID * flat.numel():
        return torch.unique(flat, sorted=True, return_inverse=True)
    seen = torch.zeros(num_rows, dtype=torch.bool, device=flat.device).index_fill_(0, flat, True)
    uniq = seen.nonzero().squeeze(1)  # (U,) ascending
    number = torch.empty(num_rows, dtype=torch.long, device=flat.device)
    number.index_copy_(0, uniq, torch.arange(len(uniq), device=flat.device))  # row id -> its place in uniq
    return uniq, number.index_select(0, flat)


def expand_rows(rows: torch.Tensor, inverse: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Unique rows ``(U, dim)`` -> one row per position, ``shape + (dim,)``.

    On the CPU ``index_select``: its backward is an ``index_add`` into ``(U, dim)``, about 2.5x faster
    there than the accumulating ``index_put`` of advanced indexing. On CUDA ``F.embedding``, whose
    backward sums a row's positions in a fixed order (``index_select``'s backward adds them with fp32
    atomics, so two runs of the same seed would drift apart in the last bits).
    """
    flat = inverse.reshape(-1)
    out = F.embedding(flat, rows) if rows.is_cuda else rows.index_select(0, flat)
    return out.view(*shape, rows.shape[-1])


_IDS_CHECKED = contextvars.ContextVar("stemlm_ids_checked", default=False)


@contextlib.contextmanager
def ids_checked():
    """Inside this context ``check_ids`` trusts its ids: the caller checked them on the host
    before moving them to an accelerator, where checking again would make the host wait."""
    token = _IDS_CHECKED.set(True)
    try:
        yield
    finally:
        _IDS_CHECKED.reset(token)


def check_ids(ids: torch.Tensor, num_rows: int) -> None:
    """Raise a one-line error when a token id is outside ``[0, num_rows)`` (skipped inside ``ids_checked``)."""
    if ids.numel() == 0 or _IDS_CHECKED.get():
        return
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= num_rows:
        bad = lo if lo < 0 else hi
        raise IndexError(f"token id {bad} out of range for a vocabulary of {num_rows} (valid 0..{num_rows - 1})")


def init_table_(weight: torch.Tensor, method: str, d_model: int, init_std: float) -> None:
    """Initialise a ``rows × d_ff`` table in place (``rows``: ``V``, or ``ngram_slots`` for n-gram keys).

    * ``xavier_normal`` (default, as the official STEM code): std = sqrt(2 / (rows + d_ff)).
    * ``matched``: std = init_std · sqrt(d_model), the std of ``W_u x`` at initialisation for a
      unit-RMS input, so a STEM layer starts at the scale of the dense layer it replaces.
    * ``normal``: std = init_std, like every other weight.
    """
    if method == "xavier_normal":
        nn.init.xavier_normal_(weight)
    elif method == "matched":
        nn.init.normal_(weight, std=init_std * math.sqrt(d_model))
    elif method == "normal":
        nn.init.normal_(weight, std=init_std)
    else:
        raise ValueError(f"unknown table_init {method!r}")


class WeightRows:
    """``read_rows``/``write_rows`` for tables whose rows are a ``weight`` tensor they hold."""

    weight: torch.Tensor

    def read_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Copy of the rows at ``ids`` (no autograd); used by optimizers, editing and export."""
        return self.weight.detach().index_select(0, ids.reshape(-1)).view(*ids.shape, self.weight.shape[1])

    @torch.no_grad()
    def write_rows(self, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """Overwrite the rows at ``ids`` in place (the last write wins for a repeated id)."""
        self.weight[ids] = rows.to(self.weight.dtype)


class TableLookup:
    """What every table kind shares: index ids, look up one table alone, say which rows a gradient is for.

    A subclass provides ``num_rows``, ``dim``, ``sparse_grad`` and ``gather(uniq)``.
    """

    num_rows: int
    dim: int
    sparse_grad: bool

    def index(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(unique_ids, inverse)`` of ``ids``, checked against the table's rows."""
        check_ids(ids, self.num_rows)
        return unique_ids(ids, self.num_rows)

    def gather(self, uniq: torch.Tensor) -> torch.Tensor:
        """Rows ``(U, dim)`` for unique ids."""
        raise NotImplementedError

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows for ``ids`` (any shape) of this table alone -> ``ids.shape + (dim,)``. A table trained
        row-sparse (``sparse_grad``) is looked up under autograd through its container, which hands
        the gradient over (``Tables.rows``, ``take_step``): here that is refused in one line."""
        if self.sparse_grad and torch.is_grad_enabled():
            raise RuntimeError("a table with sparse_grad is looked up under autograd through its container "
                               "(Tables.rows), which records the rows' gradient for the optimizer")
        uniq, inverse = self.index(ids)
        rows = self.gather(uniq)
        return expand_rows(rows, inverse.to(rows.device), ids.shape)

    def own_grad(self, uniq: torch.Tensor, leaf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(row ids, gradient (U, dim))`` this table applies for a recorded leaf of the rows of ``uniq``
        (None without a gradient). Rows are the table's own: ``ShardedTable`` averages over ranks and
        keeps the rows it stores (a collective there: call it for every leaf, gradient or not)."""
        return None if leaf.grad is None else (uniq, leaf.grad)


class TouchedRows:
    """The rows a training step gathered under autograd from tables with ``sparse_grad``: per layer key,
    ``(unique_ids (U,), leaf (U, dim))`` pairs, one per lookup (a micro-batch, a forward); backward
    fills the leaves' ``.grad``. Opened by the container (``Tables.begin_step``, or the first lookup),
    handed to the optimizer by ``Tables.take_step``."""

    def __init__(self):
        self.pairs: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def leaf(self, key: str, uniq: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """``rows (U, dim)`` as a fresh leaf recorded for layer ``key``: backward gives it a ``(U, dim)``
        gradient of the touched rows only, never a dense ``V × dim`` one."""
        leaf = rows.detach().requires_grad_(True)
        self.pairs.setdefault(key, []).append((uniq, leaf))
        return leaf

    def of(self, key: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The ``(unique_ids, leaf)`` pairs of layer ``key`` (empty if it was not looked up)."""
        return self.pairs.get(key, [])


class StemTable(WeightRows, TableLookup, nn.Module):
    """A table held as a parameter in the model's own memory (the ``device`` tier).

    With ``sparse_grad`` set, a gather copies the unique rows out of the parameter (no autograd
    edge into it): the container makes them a leaf (``TouchedRows``), so backward produces a
    ``(U, d_ff)`` gradient for the touched rows only and never a dense ``V × d_ff`` one.
    """

    def __init__(self, num_rows: int, dim: int):
        super().__init__()
        self.num_rows, self.dim = num_rows, dim
        self.weight = nn.Parameter(torch.empty(num_rows, dim))
        self.sparse_grad = False

    def gather(self, uniq: torch.Tensor) -> torch.Tensor:
        """Rows ``(U, dim)`` for unique ids (a copy, outside autograd, under ``sparse_grad``)."""
        if self.sparse_grad:
            return self.weight.detach().index_select(0, uniq)
        return F.embedding(uniq, self.weight)

    def extra_repr(self) -> str:
        return f"{self.num_rows}, {self.dim}, sparse_grad={self.sparse_grad}"


def trained_whole(tables) -> bool:
    """Whether ``tables`` (table modules) are in-memory ``StemTable``s without ``sparse_grad``: parameters
    that torch AdamW trains whole (``optim.table_optimizer=dense``). Their lookups under autograd index the
    table itself (``Tables.rows``), so a step over them has static shapes and can be captured."""
    return all(type(t) is StemTable and not t.sparse_grad for t in tables)


class _SumRows(torch.autograd.Function):
    """``F.embedding_bag(bags, rows, mode="sum")`` whose backward is one ``index_add_`` per key column
    (``K`` passes over the ``(B·T, dim)`` gradient) instead of the bag's dense backward: the same
    gradient, about twice as fast on CPU (K = 5, 4,096 positions, 688 wide: 3.1 against 6.1 ms)."""

    @staticmethod
    def forward(ctx, rows, bags):
        ctx.save_for_backward(bags)
        ctx.num_rows = rows.shape[0]
        return F.embedding_bag(bags, rows, mode="sum")

    @staticmethod
    def backward(ctx, grad):  # grad (B·T, dim)
        (bags,) = ctx.saved_tensors
        out = grad.new_zeros(ctx.num_rows, grad.shape[1])
        for k in range(bags.shape[1]):  # in key order: a fixed summation order, the same gradient every run
            out.index_add_(0, bags[:, k], grad)
        return out, None


def sum_rows(rows: torch.Tensor, bags: torch.Tensor) -> torch.Tensor:
    """``(N, dim)``: for each bag of ``bags (N, K)`` the sum of its ``K`` rows of ``rows (U, dim)``. On the CPU
    with gradients, through ``_SumRows`` (elsewhere ``embedding_bag``'s own backward, deterministic on CUDA where
    ``index_add_`` is not)."""
    if rows.device.type == "cpu" and rows.requires_grad and torch.is_grad_enabled():
        return _SumRows.apply(rows, bags)
    return F.embedding_bag(bags, rows, mode="sum")


class LayerRows(Mapping):
    """The rows of every table layer for one batch of ids: ``rows[key] -> ids.shape + (dim,)``.

    The ids were made unique once for all layers; a layer's unique rows are gathered when its key
    is read (so the gathers of later layers, prefetched in the background, overlap the compute of
    earlier ones) and are not kept: read each key once, as ``StemLM.forward`` does.
    """

    def __init__(self, gathers: dict[str, Callable[[], torch.Tensor]], inverse: torch.Tensor, shape: torch.Size):
        self._gathers, self.inverse, self.shape = gathers, inverse, shape

    def __getitem__(self, key: str) -> torch.Tensor:
        rows = self._gathers[key]()  # (U, dim)
        return expand_rows(rows, self.inverse.to(rows.device), self.shape)

    def summed(self, key: str) -> torch.Tensor:
        """Layer ``key``'s rows summed over the keys' last axis, ``shape[:-1] + (dim,)``: an n-gram layer's
        memory ``Σ_k U[k]`` in one gather-and-sum (``F.embedding_bag``), never ``shape + (dim,)`` rows."""
        rows = self._gathers[key]()  # (U, dim)
        bags = self.inverse.to(rows.device).reshape(-1, self.shape[-1])  # (B·T, K)
        return sum_rows(rows, bags).view(*self.shape[:-1], rows.shape[-1])

    def __iter__(self) -> Iterator[str]:
        return iter(self._gathers)

    def __contains__(self, key) -> bool:  # without gathering (Mapping's own would read the key)
        return key in self._gathers

    def __len__(self) -> int:
        return len(self._gathers)


class MergedRows(Mapping):
    """Several ``LayerRows`` (of disjoint layers, each over its own keys) seen as one mapping."""

    def __init__(self, *parts: Mapping):
        self._parts = parts

    def __getitem__(self, key: str):
        for part in self._parts:
            if key in part:
                return part[key]
        raise KeyError(key)

    def __iter__(self) -> Iterator[str]:
        return (k for part in self._parts for k in part)

    def __contains__(self, key) -> bool:
        return any(key in part for part in self._parts)

    def summed(self, key: str) -> torch.Tensor:
        """``summed_rows`` of the part holding ``key``."""
        return summed_rows(next(part for part in self._parts if key in part), key)

    def __len__(self) -> int:
        return sum(len(part) for part in self._parts)


def summed_rows(table_rows: Mapping, key: str) -> torch.Tensor:
    """Layer ``key``'s n-gram rows summed over their K keys, ``(..., dim)``: one gather-and-sum where the
    mapping can (``LayerRows.summed``), else its rows ``(..., K, dim)`` summed."""
    if isinstance(table_rows, (LayerRows, MergedRows)):
        return table_rows.summed(key)
    return as_rows(table_rows[key]).sum(-2)


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


class Tables(nn.ModuleDict):
    """All tables of a model keyed by layer (``"1"``, ``"3"``, ...), installed as ``model.tables``.

    This class serves tables held in the model's memory (``StemTable``, or ``ShardedTable`` on a
    rank); ``stemlm.store.TableStore`` is the same container for the host and disk tiers. Every
    tier is also the handle callers keep: ``prefetch``, ``stats``, ``flush`` and ``close`` are
    no-ops here, and it is a context manager.
    """

    tier = "device"  # the model's own memory (stemlm.store.tiers.DeviceTier)

    def __init__(self, tables: Mapping[str, nn.Module] | None = None):
        super().__init__(tables)
        self.touched: TouchedRows | None = None  # the open training step's recorded rows (sparse_grad)

    def index(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(unique_ids, inverse)`` of ``ids`` for all layers at once (the tables of a model index
        alike: the first one does it; a sharded table makes it the union over the ranks)."""
        return next(iter(self.values())).index(ids)

    def rows(self, ids: torch.Tensor, layers: tuple[str, ...] | None = None) -> LayerRows:
        """Every layer's rows for ``ids (B, T)`` (or n-gram keys ``(B, T, K)``): ids made unique once,
        rows gathered per layer; ``layers`` keeps only those layer keys (a model whose layers are keyed
        two ways asks once per key kind, ``StemLM.table_rows``)."""
        tables = {k: t for k, t in self.items() if layers is None or k in layers}
        if not tables:  # a dense model: nothing to index
            return LayerRows({}, ids, ids.shape)
        if torch.is_grad_enabled() and trained_whole(tables.values()):
            # every position indexes the table itself, with no torch.unique: static shapes, no host sync (a
            # capturable step, run.step_graph); index_select's backward adds each position's gradient into
            # the (V, dim) gradient in position order, as the unique rows' expansion did
            check_ids(ids, next(iter(tables.values())).num_rows)
            return LayerRows({k: (lambda t=t: t.weight) for k, t in tables.items()}, ids, ids.shape)
        uniq, inverse = next(iter(tables.values())).index(ids)  # as ``index``: the first table indexes for all
        return LayerRows({k: (lambda k=k, t=t: self.track(k, t, uniq, t.gather(uniq))) for k, t in tables.items()},
                         inverse, ids.shape)

    def track(self, key: str, table, uniq: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Layer ``key``'s gathered rows ``(U, dim)``, as a leaf recorded in the open step's ``TouchedRows``
        when ``table`` trains row-sparse under autograd (a step is opened if none is); else as they are."""
        if not (table.sparse_grad and torch.is_grad_enabled()):
            return rows
        if self.touched is None:
            self.touched = TouchedRows()
        return self.touched.leaf(key, uniq, rows)

    def prefetch(self, ids: torch.Tensor) -> None:
        """Start gathering the rows of ``ids`` ahead of the forward (nothing to do in memory)."""

    # -- training: one optimizer step over several micro-batches -----------------------------------
    def begin_step(self, ids, ticket=None) -> TouchedRows:
        """Open an optimizer step over the micro-batches' ids ``ids`` (a list of ``(B, T)``); ``ticket``
        is what ``prefetch_step`` returned for exactly these ids, or None. Here: a fresh ``TouchedRows``
        that every lookup of the step records into (rows are gathered per lookup; the fused path
        gathers the step's rows once, ``stemlm.train.fused``)."""
        self.touched = TouchedRows()
        return self.touched

    def take_step(self) -> TouchedRows | None:
        """The step's recorded rows and, after backward, their gradients (for the optimizer), closing the
        step; None if nothing was recorded."""
        touched, self.touched = self.touched, None
        return touched

    def prefetch_step(self, ids):
        """Start moving the rows of the *next* step's ids ``ids`` towards the compute device (host-RAM
        training tables); returns the ticket to hand to that step's ``begin_step``. Nothing here."""
        return None

    prepares_steps = False  # whether prepare_step does anything (the loop skips computing its keys otherwise)

    def prepare_step(self, ids, ticket=None) -> None:
        """Make the rows of the coming step's ids ``ids`` ready where its (possibly captured) step reads
        them, before the step runs (``SlabTables`` loads them into its device slab). Nothing here."""

    def device_views(self, device) -> dict[str, torch.Tensor] | None:
        """Each layer's rows as a tensor ``device`` reads in place, for tiers whose rows live off the
        model (``TableStore``: host RAM through a UVA view); None here, where the tables are modules."""
        return None

    def stats(self) -> dict:
        """The counters of ``TableStore.stats``: all zero, rows in memory are not traffic."""
        return {"tier": self.tier, "tables": len(self), "prefetch": False, **TableStats().as_dict(), "per_table": {}}

    def reset_stats(self) -> None:
        """Zero every counter (none here)."""

    def flush(self) -> None:
        """Make written rows durable (they are, in memory)."""

    def close(self) -> None:
        """Release what the tables hold (nothing in memory)."""

    def __enter__(self) -> "Tables":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
