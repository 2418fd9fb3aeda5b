"""``FusedRowAdamW``: the row-sparse AdamW of ``SparseRowAdamW`` over all tables at once.

It drives a ``FusedTables`` (or its host tier, ``HostTables``): the step's rows are one leaf
``(n, P, d)`` whose gradient already holds every micro-batch's contribution, so ``collect`` is a
view, not a coalescing pass; ``step`` computes the per-row factors on the ``(n, P)`` counters and
updates rows and moments of every table with one fused update (``kernels.py``). The state is
stacked (``exp_avg``/``exp_avg_sq`` ``(n, V, d)``, ``step``/``last_step`` ``(n, V)``) but reads
and writes the per-table keys of ``SparseRowAdamW.state_dict``, so checkpoints of either path
resume on the other.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ..sparse_adam import load_scalars, table_state_dict
from ...kernels import TRITON_KERNELS
from . import cpu_kernel
from .kernels import Kernel, indexed_update_, row_factors, window_update_
from .stacked import FusedTables

STATE_KEYS = ("exp_avg", "exp_avg_sq", "step", "last_step")


class FusedRowAdamW:
    """AdamW on the touched rows of every table of a ``FusedTables`` (see module docstring)."""

    def __init__(self, tables: FusedTables, lr: float, betas=(0.9, 0.95), eps: float = 1e-8,
                 weight_decay: float = 0.0, decay_untouched: str = "lazy", compile: bool = False):
        """``compile``: run the update as compiled kernels (on the CPU the C++ loop of ``cpu_kernel``;
        falls back to eager with a warning)."""
        if decay_untouched not in ("lazy", "catchup"):
            raise ValueError(f"decay_untouched must be 'lazy' or 'catchup', got {decay_untouched!r}")
        self.container = tables
        self.tables = dict(tables.items())
        self.lr, self.betas, self.eps, self.weight_decay = lr, tuple(betas), eps, weight_decay
        self.decay_untouched = decay_untouched
        self.global_step = 0
        self._pending = None  # the closed step whose gradients were collected
        self.scalars: tuple[torch.Tensor, torch.Tensor] | None = None  # (lr, step) on the device: use_device_scalars
        self.indexed = Kernel(indexed_update_, compile)
        self.window = Kernel(window_update_, compile)
        for t in self.tables.values():
            t.sparse_grad = True

    @property
    def triton(self) -> bool:
        """Whether the update runs as the Triton row AdamW (``run.table_kernels=triton`` or ``triton-gemm``)."""
        return self.container.kernels in TRITON_KERNELS

    @property
    def compile(self) -> bool:
        return self.indexed.compiled and self.window.compiled

    @property
    def stacked(self) -> dict[str, torch.Tensor]:
        """The stacked state, kept by the tables' container beside the rows."""
        return self.container.optim_state()

    @property
    def state(self) -> dict[str, dict[str, torch.Tensor]]:
        """Per-table views of the state, keyed as ``SparseRowAdamW.state``."""
        st = self.stacked
        return {name: {k: st[k][i] for k in STATE_KEYS} for i, name in enumerate(self.tables)}

    # -- gradients ------------------------------------------------------------------------
    def collect(self) -> list[torch.Tensor]:
        """The step's gradients, one ``(P, d)`` view per table (clipping scales them in place)."""
        if self._pending is None:
            self._pending = self.container.take_step()
        step = self._pending
        if step is None or step.grad is None:
            return []
        return list(step.grad.unbind(0))

    def zero_grad(self) -> None:
        """Drop the step's rows and gradients."""
        self._pending = None
        self.container.take_step()

    # -- update ---------------------------------------------------------------------------
    @torch.no_grad()
    def step(self) -> None:
        """One AdamW step on the rows of the step, every table at once."""
        self.collect()
        step, self._pending = self._pending, None
        self.global_step += 1
        if self.scalars is not None:
            self.scalars[1].add_(1)  # the device's copy of the step counter (a captured step replays this)
        if step is None or step.grad is None:
            return
        self.container.apply_update(self, step)

    def use_device_scalars(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        """Read the learning rate and the step counter from device tensors ``(lr, step)`` (fp64, int64)
        instead of Python numbers, so a captured CUDA graph of the update replays with the values
        written into them before each replay (``sync_device_scalars``); the C++ CPU loop is not used then."""
        self.scalars = (torch.tensor(float(self.lr), dtype=torch.float64, device=device),
                        torch.tensor(self.global_step, dtype=torch.int64, device=device))
        return self.scalars

    def sync_device_scalars(self) -> None:
        """Write the host's learning rate and step counter into the device scalars (before a step)."""
        self.scalars[0].fill_(float(self.lr))
        self.scalars[1].fill_(self.global_step)

    def factors(self, counts: torch.Tensor, last: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``(n, decay, neg_step, eps_r)`` of this step for rows with these counters."""
        lr, global_step = self.scalars if self.scalars is not None else (self.lr, self.global_step)
        return row_factors(counts, last, lr, self.weight_decay, global_step, self.betas, self.eps,
                           self.decay_untouched == "catchup")

    def stamp(self, last: torch.Tensor) -> torch.Tensor:
        """The update counter's value for rows updated this step, shaped like ``last``."""
        if self.scalars is not None:
            return self.scalars[1].expand_as(last)
        return torch.full_like(last, self.global_step)

    def _native(self, weight, m, v, counts, last, flat, w_rows, grad) -> bool:
        """The whole update as the CPU's C++ loop (``compile`` on the CPU), if it applies."""
        return self.compile and cpu_kernel.row_adamw_(
            weight, m, v, counts, last, flat, w_rows, grad, lr=self.lr, weight_decay=self.weight_decay,
            global_step=self.global_step, betas=self.betas, eps=self.eps, catchup=self.decay_untouched == "catchup")

    def update_indexed(self, step, flat: torch.Tensor, valid: torch.Tensor | None) -> None:
        """Update the rows ``flat`` of the stacked state where the container updates (``update_target``) from
        the step's leaf."""
        storage, st = self.container.update_target()
        n, P, d = step.rows.shape
        weight, m, v = storage.view(-1, d), st["exp_avg"].view(-1, d), st["exp_avg_sq"].view(-1, d)
        counts, last = st["step"].view(-1), st["last_step"].view(-1)
        w_rows, grad = step.rows.detach().reshape(-1, d), step.grad.reshape(-1, d)
        if valid is None and self._plain and self._native(weight, m, v, counts, last, flat, w_rows, grad):
            return
        mask = None if valid is None else valid.view(1, P).expand(n, P).reshape(-1, 1)  # (n·P, 1)
        self._update_rows(weight, m, v, counts, last, flat, w_rows, grad, mask)

    def update_window(self, rows: torch.Tensor, grad: torch.Tensor, win, valid: torch.Tensor | None = None) -> None:
        """Update a compact window of rows (host tier) in place: ``rows``/``grad`` ``(n, U, d)``,
        ``win`` holding the window's moments ``m``/``v`` and counters ``step``/``last``; ``valid (U,)``
        marks the slots the step used (cached rows it did not use stay unchanged), None = all."""
        n, U, d = rows.shape
        flat = torch.arange(n * U, device=rows.device)  # the window's rows are updated where they are
        args = (rows.view(-1, d), win.m.view(-1, d), win.v.view(-1, d), win.step.view(-1), win.last.view(-1), flat,
                rows.view(-1, d), grad.reshape(-1, d))
        if valid is None and self._plain:  # every row updated: no gather, no masked write-back
            if self._native(*args):
                return
            new_n, decay, neg_step, eps_r = self.factors(win.step, win.last)
            win.step.copy_(new_n)
            win.last.copy_(self.stamp(win.last))
            self.window(rows, win.m, win.v, grad, decay, neg_step, eps_r, *self.betas)
            return
        self._update_rows(*args, None if valid is None else valid.view(1, U).expand(n, U).reshape(-1, 1))

    @property
    def _plain(self) -> bool:
        """Neither the Triton kernels nor device scalars: the CPU's C++ loop and the in-place window update apply."""
        return not self.triton and self.scalars is None

    def _update_rows(self, weight, m, v, counts, last, flat, w_rows, grad, mask) -> None:
        """AdamW on rows ``flat`` of ``(R, d)`` rows and moments and ``(R,)`` counters, from the rows' current
        values ``w_rows`` and gradients ``grad`` (``(K, d)``); ``mask (K, 1)`` leaves the other rows as they are."""
        old_n, old_last = counts.index_select(0, flat), last.index_select(0, flat)  # (K,)
        new_n, decay, neg_step, eps_r = self.factors(old_n, old_last)
        stamp = self.stamp(old_last)
        if mask is not None:
            new_n, stamp = torch.where(mask[:, 0], new_n, old_n), torch.where(mask[:, 0], stamp, old_last)
        counts.index_copy_(0, flat, new_n)
        last.index_copy_(0, flat, stamp)
        update = self.container.kernel_modules()[1].row_adamw_ if self.triton else self.indexed
        update(weight, m, v, flat, w_rows, grad, decay, neg_step, eps_r, mask, *self.betas)

    # -- checkpointing --------------------------------------------------------------------
    def state_dict(self) -> tuple[dict[str, torch.Tensor], dict]:
        """``(tensors, scalars)`` in the format of ``SparseRowAdamW.state_dict``."""
        self.container.flush()
        return table_state_dict(self)

    def load_state_dict(self, tensors: Mapping[str, torch.Tensor], meta: dict) -> None:
        """Restore what ``state_dict`` (of either table optimizer) wrote."""
        load_scalars(self, meta)
        for name in meta["tables"]:
            if name not in self.tables:
                raise ValueError(f"optimizer state has table {name!r} but the model has tables {sorted(self.tables)}")
        self.container.flush()
        stacked, names = self.stacked, list(self.tables)
        for key, ref in stacked.items():
            for i, name in enumerate(names):
                if name not in meta["tables"]:
                    ref[i].zero_()
                    continue
                src = tensors[f"{name}.{key}"]
                if src.shape != ref[i].shape:
                    raise ValueError(f"optimizer state {name}.{key} has shape {tuple(src.shape)}, "
                                     f"table expects {tuple(ref[i].shape)}")
                ref[i].copy_(src)
        self.container.state_loaded()

    def parameters(self) -> list[torch.nn.Parameter]:
        """The tables' parameters (views of the stacked rows; for the coverage check)."""
        return [p for t in self.tables.values() for p in t.parameters()]
