"""``FusedTables``: every table of a model in one stacked ``(n_tables, V, d_ff)`` tensor.

Installed as ``model.tables`` in place of ``Tables`` (``install_fused_tables``, applied from
outside the model, after it is on its device). Each layer's ``StemTable`` stays a member and its
``weight`` parameter becomes a view of the stacked tensor, so state-dict keys, checkpoints and
``read_rows``/``write_rows`` are unchanged. What changes is the work per step:

* ``begin_step(ids_list)`` dedups the ids of *all* micro-batches of an optimizer step once, with
  static shapes (``dedup.py``), and gathers the rows of every table with one ``index_select``
  into one leaf ``(n, P, d)``; weights do not change within a step, so every micro-batch reads
  that leaf and backward accumulates its gradient there (no per-table coalescing);
* ``rows(ids)`` expands each layer's rows with the step's ``slot_of`` map (no ``torch.unique``);
* the optimizer (``FusedRowAdamW``) updates the rows of every table with one fused update.

Nothing in a step reads a value back to the host on an accelerator: ids are checked on the host
by the trainer (``stemlm.model.tables.ids_checked``) or on the device with ``torch._assert_async``.
Without ``begin_step``, a forward under autograd opens the step with its own ids (one forward
per optimizer step); outside autograd rows are gathered per call.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn

from ...ffn.rows import IndexedRows, add_rows_
from ...kernels import TRITON_KERNELS
from ...model.tables import LayerRows, StemTable, Tables, check_ids
from .dedup import Dedup, dedup
from .mover import to_device_async


@dataclass
class StepRows:
    """The rows of one optimizer step: ``dedup`` of its ids and ``rows`` ``(n, P, d)``, which collect
    every micro-batch's gradient in ``grad``: the leaf's ``.grad`` on the torch kernels, an explicit
    buffer (``explicit_grad``) the Triton kernels add into; ``implicit`` when opened by a forward."""

    dedup: Dedup
    rows: torch.Tensor
    implicit: bool = False
    used: bool = False
    explicit_grad: torch.Tensor | None = None

    @property
    def grad(self) -> torch.Tensor | None:
        """``(n, P, d)`` fp32: the step's row gradients so far (None before any backward)."""
        return self.explicit_grad if self.explicit_grad is not None else self.rows.grad


class ExpandRows(torch.autograd.Function):
    """Every table's rows at every position in one gather: ``rows (n, P, d)``, ``inverse (N,)`` ->
    ``n`` tensors ``(N, d)``. Backward accumulates each table's position gradients straight into
    its slice of one ``(n, P, d)`` gradient (no per-table gradient tensors stacked afterwards)."""

    @staticmethod
    def forward(ctx, rows, inverse):
        ctx.save_for_backward(inverse)
        ctx.rows_shape = rows.shape
        return tuple(rows.index_select(1, inverse).unbind(0))  # n x (N, d), views of one (n, N, d) gather

    @staticmethod
    def backward(ctx, *grads):
        (inverse,) = ctx.saved_tensors
        n, P, d = ctx.rows_shape
        out = grads[0].new_zeros(n, P, d) if grads[0] is not None else None
        for i, g in enumerate(grads):
            if g is not None:
                if out is None:
                    out = g.new_zeros(n, P, d)
                add_rows_(out[i], inverse, g.reshape(-1, d))  # index_select's backward, in a fixed order
        return out, None


class PassedRows(LayerRows):
    """``LayerRows`` whose values are handed out as they are (``IndexedRows`` per layer)."""

    def __getitem__(self, key: str):
        return self._gathers[key]

    def summed(self, key: str) -> torch.Tensor:
        return self[key].expand().sum(-2)


class ExpandedRows(LayerRows):
    """``LayerRows`` whose rows are already one per position (``(N, d)`` each)."""

    def __getitem__(self, key: str) -> torch.Tensor:
        rows = self._gathers[key]()
        return rows.view(*self.shape, rows.shape[-1])

    def summed(self, key: str) -> torch.Tensor:
        return self[key].sum(-2)


def assert_on_device(cond: torch.Tensor, message: str) -> None:
    """Raise ``message`` when ``cond`` (0-d bool) is false: at once on the CPU, asynchronously
    (a device-side assert, no host sync) on an accelerator."""
    if cond.device.type == "cpu":
        if not bool(cond):
            raise IndexError(message)
    else:
        torch._assert_async(cond, message)


class FusedTables(Tables):
    """All tables of a model stacked on one device (see module docstring)."""

    def __init__(self, tables: Mapping[str, StemTable], exact: bool | None = None, kernels: str = "torch"):
        """``kernels``: ``torch`` (autograd expands the rows per position), ``triton`` (the rows
        reach STEM layers as ``IndexedRows``: the gather is fused into the product and the row
        gradient is a segmented sum, ``stemlm.kernels``) or ``triton-gemm`` (the same, inside the
        epilogues of the gate's GEMM and of the down projection's backward GEMM)."""
        super().__init__()
        first = next(iter(tables.values()))
        weights = [t.weight.detach() for t in tables.values()]
        if any(w.shape != first.weight.shape or w.dtype != torch.float32 for w in weights):
            raise ValueError("the fused table path needs fp32 tables of one shape")
        self.storage = torch.stack(weights)  # (n, V, d): not a buffer, the members' weights are its views
        for i, (name, table) in enumerate(tables.items()):
            table.weight = nn.Parameter(self.storage[i])  # aliases storage[i]
            self[name] = table
        self.num_rows, self.dim = first.num_rows, first.dim
        self.exact = self.storage.device.type == "cpu" if exact is None else exact
        self.step_rows: StepRows | None = None
        self._state: dict[str, torch.Tensor] | None = None
        self.kernels = kernels
        self._kernel_modules = None

    @property
    def device(self) -> torch.device:
        return self.storage.device

    # -- a step -----------------------------------------------------------------------------
    def begin_step(self, ids: Sequence[torch.Tensor], ticket=None) -> StepRows:
        """Dedup the ids of every micro-batch of the coming optimizer step and gather their rows
        (``ticket``: unused here, the rows are on the device)."""
        flat = torch.cat([i.reshape(-1).to(ids[0].device) for i in ids])
        check_ids(flat, self.num_rows)  # where the ids are: on the host (the trainer's) no device waits
        flat = to_device_async(flat, self.device)
        d = dedup(flat, self.num_rows, self.exact)
        self.step_rows = self.open_step(d, self.load_rows(d))
        return self.step_rows

    def open_step(self, d: Dedup, rows: torch.Tensor) -> StepRows:
        """The step's ``StepRows`` over ``rows (n, P, d)``: a leaf that requires grad (torch
        kernels) or plain rows beside a zeroed gradient buffer (Triton kernels)."""
        if self.kernels in TRITON_KERNELS:
            return StepRows(d, rows.detach(), explicit_grad=torch.zeros(rows.shape, dtype=torch.float32,
                                                                        device=rows.device))
        return StepRows(d, rows.requires_grad_(True))

    def kernel_modules(self):
        """``(gated_rows, row_adamw, gated_gemm or None)`` of ``stemlm.kernels`` for this container's device
        (loaded once; ``gated_gemm`` with ``kernels="triton-gemm"``)."""
        if self._kernel_modules is None:
            from ... import kernels
            gemm = kernels.load_gemm(self.device) if self.kernels == "triton-gemm" else None
            self._kernel_modules = (*kernels.load(self.device), gemm)
        return self._kernel_modules

    def load_rows(self, d: Dedup) -> torch.Tensor:
        """``(n, P, d)`` rows of every table at the step's slots (a fresh tensor)."""
        return self.storage.index_select(1, self.slots(d))

    def slots(self, d: Dedup) -> torch.Tensor:
        """``(P,)`` where each of the step's slots lives along ``storage``'s dim 1: its id here (``SlabTables``:
        its slab slot)."""
        return d.uniq

    def take_step(self) -> StepRows | None:
        """The current step's rows (for the optimizer), closing the step."""
        step, self.step_rows = self.step_rows, None
        return step

    # -- lookups ----------------------------------------------------------------------------
    def rows(self, ids: torch.Tensor) -> LayerRows:
        """Every layer's rows for ``ids (B, T)``; under autograd from the step's leaf."""
        if not torch.is_grad_enabled():
            return self._rows_no_grad(ids)
        step = self.step_rows
        if step is None:
            step = self.begin_step([ids])
            step.implicit = True
        elif step.implicit and step.used:
            raise RuntimeError("several forward passes in one optimizer step: call model.tables.begin_step(...) "
                               "with the ids of all of them first")
        keys = self.step_keys(ids.to(self.device))  # the ids as the step's dedup counts them
        if not step.implicit:
            assert_on_device(step.dedup.contains(keys), "a forward pass used token ids that begin_step was not given")
        step.used = True
        inverse = step.dedup.inverse(keys).reshape(-1)  # (N,)
        if self.kernels in TRITON_KERNELS:
            gated, _, gemm = self.kernel_modules()
            seg = gated.Segments.of(inverse, step.dedup.size)  # one sort, shared by every layer
            per_layer = {k: IndexedRows(step.rows[i], inverse, ids.shape, seg, step.explicit_grad[i], gated, gemm)
                         for i, k in enumerate(self.keys())}
            return PassedRows(per_layer, inverse, ids.shape)
        per_table = ExpandRows.apply(step.rows, inverse)  # n x (N, d)
        return ExpandedRows({k: (lambda r=r: r) for k, r in zip(self.keys(), per_table)}, inverse, ids.shape)

    def step_keys(self, ids: torch.Tensor) -> torch.Tensor:
        """The ids (on the device) as the step's dedup counts them: themselves here; slots for ``SlabTables``."""
        return ids

    def _rows_no_grad(self, ids: torch.Tensor) -> LayerRows:
        ids = ids.to(self.device)
        check_ids(ids, self.num_rows)
        d = dedup(ids, self.num_rows, self.exact)
        per_table = self.load_rows(d).unbind(0)
        return LayerRows({k: (lambda r=r: r) for k, r in zip(self.keys(), per_table)}, d.inverse(ids), ids.shape)

    # -- where the optimizer state lives -------------------------------------------------------
    def optim_state(self) -> dict[str, torch.Tensor]:
        """The stacked optimizer state beside the rows (zeroed on first use): moments
        ``exp_avg``/``exp_avg_sq`` ``(n, V, d)`` fp32, counters ``step``/``last_step`` ``(n, V)`` int64."""
        if self._state is None:
            n, V, d = self.storage.shape
            z = lambda *shape, dt=torch.float32: self.zeros(shape, dt)  # noqa: E731
            self._state = {"exp_avg": z(n, V, d), "exp_avg_sq": z(n, V, d), "step": z(n, V, dt=torch.int64),
                           "last_step": z(n, V, dt=torch.int64)}
        return self._state

    def zeros(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """Zeros where the stacked rows live."""
        return torch.zeros(shape, dtype=dtype, device=self.storage.device)

    def update_target(self) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Where the optimizer updates rows: the stacked rows ``(n, R, d)`` and their state (``optim_state``)."""
        return self.storage, self.optim_state()

    def apply_update(self, opt, step: StepRows) -> None:
        """Let ``opt`` update the step's rows where they live: the stacked rows at flat index
        ``table · R + slot`` (``R = storage.shape[1]``, ``slots``) of every (table, slot), padded slots masked."""
        n, R = self.storage.shape[:2]
        flat = (torch.arange(n, device=self.device)[:, None] * R + self.slots(step.dedup)[None, :]).reshape(-1)  # (n·P,)
        opt.update_indexed(step, flat, step.dedup.valid())

    def state_loaded(self) -> None:
        """Called after the optimizer state was replaced (nothing cached here)."""


def install_fused_tables(model: nn.Module, exact: bool | None = None, kernels: str = "torch") -> FusedTables:
    """Replace ``model.tables`` (in-memory ``StemTable``s) by one ``FusedTables``; returns it."""
    tables = dict(model.tables.items())
    if not tables or not all(type(t) is StemTable for t in tables.values()):
        raise ValueError("the fused table path needs the model's tables in memory as StemTables")
    model.tables = FusedTables(tables, exact, kernels)
    return model.tables
