"""Row-sparse AdamW for STEM tables: only the rows touched in a step are read, updated and written.

It drives the tables' container (``model.tables``: ``stemlm.model.tables.Tables``, or a host/disk
``TableStore``), whose tables follow this protocol:

* ``sparse_grad`` (set True here): the container records every lookup under autograd as a
  ``(unique_ids, rows_leaf)`` pair in the step's ``TouchedRows`` (one forward shares its
  ``unique_ids`` across layers), and ``take_step()`` hands that record over;
* ``own_grad(unique_ids, leaf) -> (row_ids, grad (U, dim))``: the rows the table updates (its own
  rows: a sharded table keeps the ones it stores, the gradient averaged over ranks);
* ``read_rows(ids) -> (len(ids), dim)`` and ``write_rows(ids, rows)``;
* ``num_rows``, ``dim``.

One step: ``collect()`` takes the step's recorded lookups from the container and coalesces the
gradients of the same id across lookups and micro-batches (``index_add`` over the unique ids), so the result
is exactly the non-zero rows of the dense gradient; the trainer folds them into the global
gradient norm and clips them in place (``optim.clip_grad_norm``); ``step()`` then applies AdamW
row by row:

    m_r = b1 m_r + (1-b1) g_r;  v_r = b2 v_r + (1-b2) g_r^2;  n_r = n_r + 1
    w_r = w_r (1 - lr wd) - lr (m_r / (1 - b1^n_r)) / (sqrt(v_r / (1 - b2^n_r)) + eps)

with ``n_r`` the row's own update count (bias correction per row). Moments are ``num_rows × dim``
fp32 tensors kept on the table's device; only touched rows are read and written, so the cost
grows with the unique ids of a step, never with the vocabulary.

How this differs from dense AdamW on the whole table (see docs/training.md): a dense optimizer
sees zero gradients for untouched rows but still moves them (their decaying moments keep
pushing) and decays them every step. Here untouched rows stay exactly as they are:
``decay_untouched="lazy"`` decays touched rows only; ``"catchup"`` applies the decay a row missed
since its last update, ``(1 - lr wd)^missed`` at the current lr, when it is next touched.
If every row is touched every step, both modes equal ``torch.optim.AdamW``.
"""

from __future__ import annotations

import warnings
import torch

from ..ffn.rows import add_rows_
from ..model.tables import Tables, TouchedRows, WeightRows


def table_device(table) -> torch.device:
    """Where a table keeps its rows (moments are kept there too)."""
    weight = getattr(table, "weight", None)
    if isinstance(weight, torch.Tensor):
        return weight.device
    return torch.device(getattr(table, "device", "cpu"))


def coalesce(pairs: list[tuple[torch.Tensor, torch.Tensor]], dim: int, device) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Sum the gradients of equal ids over ``(ids (U_i,), grads (U_i, dim))`` pairs -> ``(ids (U,), grads (U, dim))``."""
    if not pairs:
        return None
    if len(pairs) == 1:  # one lookup: its ids are already unique
        ids, grad = pairs[0]
        return ids.to(device), grad.to(device, torch.float32)
    all_ids = torch.cat([ids.to(device) for ids, _ in pairs])
    grads = torch.cat([g.to(device, torch.float32) for _, g in pairs])  # (sum U_i, dim)
    uniq, inverse = torch.unique(all_ids, sorted=True, return_inverse=True)
    out = torch.zeros(len(uniq), dim, dtype=torch.float32, device=device)
    return uniq, add_rows_(out, inverse, grads)  # (U, dim)


def _row_update(weight, exp_avg, exp_avg_sq, ids, grad, decay, neg_step, eps_r, buf_m, buf_v, buf_w,
                b1: float, b2: float) -> None:
    """AdamW on the rows ``ids`` of ``weight`` and its moments, in place; ``torch.compile`` turns it
    into a few fused loops. ``decay``/``neg_step``/``eps_r`` are ``(U, 1)``; the ``(U, dim)``
    buffers are reused across steps (fresh ones would page-fault on every step)."""
    buf_m.copy_(exp_avg[ids].lerp(grad, 1 - b1))
    buf_v.copy_(exp_avg_sq[ids] * b2 + (1 - b2) * grad * grad)
    buf_w.copy_(weight[ids] * decay + neg_step * buf_m / (buf_v.sqrt() + eps_r))
    exp_avg.index_copy_(0, ids, buf_m)
    exp_avg_sq.index_copy_(0, ids, buf_v)
    weight.index_copy_(0, ids, buf_w)


_compiled_row_update = None


def table_state_dict(opt) -> tuple[dict[str, torch.Tensor], dict]:
    """A table optimizer's ``(tensors, scalars)``: ``opt.state[table][name]`` keyed ``"<table>.<name>"``,
    hyperparameters and the global step as json (the format of both table optimizers)."""
    tensors = {f"{t}.{k}": v for t, st in opt.state.items() for k, v in st.items()}
    meta = {"global_step": opt.global_step, "lr": opt.lr, "betas": list(opt.betas), "eps": opt.eps,
            "weight_decay": opt.weight_decay, "decay_untouched": opt.decay_untouched, "tables": sorted(opt.state)}
    return tensors, meta


def load_scalars(opt, meta: dict) -> None:
    """Set a table optimizer's global step and hyperparameters from ``table_state_dict``'s scalars."""
    opt.global_step = int(meta["global_step"])
    opt.lr, opt.betas, opt.eps = float(meta["lr"]), tuple(meta["betas"]), float(meta["eps"])
    opt.weight_decay, opt.decay_untouched = float(meta["weight_decay"]), meta["decay_untouched"]


class SparseRowAdamW:
    """AdamW over the touched rows of every table of a container (see module docstring)."""

    # a step touching at least this share of a table's rows updates the whole table in place (``_update_in_place``):
    # measured on CPU, from about 80 % of the rows that is faster than gathering and scattering them
    in_place_share = 0.85

    def __init__(self, tables: Tables, lr: float, betas=(0.9, 0.95), eps: float = 1e-8,
                 weight_decay: float = 0.0, decay_untouched: str = "lazy", compile: bool = False):
        """``tables``: the container (``model.tables``) whose ``take_step`` hands over each step's rows.
        ``compile``: run the row update of in-memory tables as one ``torch.compile``-d kernel that
        gathers, updates and scatters in place (compiled once per process, ~6 s on CPU; about 2x
        faster steps). Falls back to the eager path, with a warning, where compiling fails."""
        if decay_untouched not in ("lazy", "catchup"):
            raise ValueError(f"decay_untouched must be 'lazy' or 'catchup', got {decay_untouched!r}")
        if not isinstance(tables, Tables):
            raise TypeError(f"SparseRowAdamW takes the tables' container (model.tables, a Tables), got "
                            f"{type(tables).__name__}")
        self.compile = compile
        self.container = tables
        self.tables = dict(tables.items())
        self.lr, self.betas, self.eps, self.weight_decay = lr, tuple(betas), eps, weight_decay
        self.decay_untouched = decay_untouched
        self.global_step = 0  # optimizer steps taken (all tables)
        self.state: dict[str, dict[str, torch.Tensor]] = {}
        self._pending: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._buffers: dict[str, list[torch.Tensor]] = {}
        for table in self.tables.values():
            table.sparse_grad = True

    # -- gradients ------------------------------------------------------------------------
    def collect(self) -> list[torch.Tensor]:
        """Take the step's recorded lookups from the container and coalesce them per table; returns the
        ``(U, dim)`` grads."""
        touched = self.container.take_step() or TouchedRows()  # nothing recorded: no lookup since the last take
        for name, table in self.tables.items():
            owned = [table.own_grad(ids, leaf) for ids, leaf in touched.of(name)]
            pairs = [pair for pair in owned if pair is not None]
            if name in self._pending:  # collect() called again before step(): accumulate
                pairs.append(self._pending[name])
            got = coalesce(pairs, table.dim, table_device(table))
            if got is not None:
                self._pending[name] = got
        return [g for _, g in self._pending.values()]

    def zero_grad(self) -> None:
        """Drop collected gradients and any lookups recorded since the last step."""
        self._pending = {}
        self.container.take_step()

    # -- update ---------------------------------------------------------------------------
    @torch.no_grad()
    def step(self) -> None:
        """Apply one AdamW step to the touched rows of every table, then clear the gradients."""
        self.collect()
        self.global_step += 1
        for name, (ids, grad) in self._pending.items():
            self._update_rows(name, ids, grad)
        self._pending = {}

    def _update_rows(self, name: str, ids: torch.Tensor, grad: torch.Tensor) -> None:
        table = self.tables[name]
        st = self._state_of(name, table)
        b1, b2 = self.betas
        # index_select / index_copy_ (ids are unique): several times faster on CPU than t[ids] / t[ids] = x
        n = st["step"].index_select(0, ids) + 1  # (U,) per-row update count
        st["step"].index_copy_(0, ids, n)
        decay, neg_step, eps_r = self._row_factors(st, ids, n, grad.device)
        fp32_weight = isinstance(table, WeightRows) and table.weight.dtype == torch.float32  # updated in place
        if self.compile and fp32_weight:
            if self._update_compiled(name, table, st, ids, grad, decay, neg_step, eps_r):
                return
        if fp32_weight and len(ids) >= self.in_place_share * table.num_rows:  # most rows (n-gram keys fill their slots)
            self._update_in_place(name, table, st, ids, grad, decay, neg_step, eps_r)
            return
        buf_m, buf_v, buf_d = self._workspace(name, len(ids), grad)  # reused: no page faults per step
        m = torch.index_select(st["exp_avg"], 0, ids, out=buf_m).lerp_(grad, 1 - b1)  # (U, dim)
        v = torch.index_select(st["exp_avg_sq"], 0, ids, out=buf_v).mul_(b2).addcmul_(grad, grad, value=1 - b2)
        st["exp_avg"].index_copy_(0, ids, m)
        st["exp_avg_sq"].index_copy_(0, ids, v)
        rows = table.read_rows(ids).to(grad.device, torch.float32)  # (U, dim)
        if self.weight_decay:
            rows.mul_(decay)
        denom = torch.sqrt(v, out=buf_d).add_(eps_r)
        rows.addcdiv_(torch.mul(m, neg_step, out=buf_m), denom)  # m is stored already: reuse its buffer
        if isinstance(table, WeightRows):  # rows held as a tensor; ids are unique: index_copy_ is safe and fast
            table.weight.data.index_copy_(0, ids, rows.to(table.weight.dtype))
        else:
            table.write_rows(ids, rows)

    def _update_in_place(self, name: str, table, st: dict, ids, grad, decay, neg_step, eps_r) -> None:
        """The row update of a step that touched most rows, on the whole table and its moments in place: the
        few untouched rows are saved before and put back after, so they do not change (lazy AdamW). The
        arithmetic of every touched row is that of the gathered update, bit for bit, in 7 passes over the
        table instead of 15 over the touched rows (the gathers and scatters of rows and moments go)."""
        b1, b2 = self.betas
        n = table.num_rows
        untouched = torch.ones(n, dtype=torch.bool, device=ids.device).index_fill_(0, ids, False).nonzero().squeeze(1)
        weight, exp_avg, exp_avg_sq = table.weight.data, st["exp_avg"], st["exp_avg_sq"]
        kept = [t.index_select(0, untouched) for t in (weight, exp_avg, exp_avg_sq)]  # (n - U, dim) each
        full_grad, buf_m, buf_d = self._workspace(name, n, grad)  # (n, dim) each
        in_order = not len(untouched) and bool((ids[1:] > ids[:-1]).all())  # ids = 0 .. n-1: grad is the table's
        if in_order:
            full_grad = grad
        else:
            full_grad.index_copy_(0, ids, grad).index_fill_(0, untouched, 0.0)

        def per_row(x: torch.Tensor, fill: float) -> torch.Tensor:  # (U, 1) -> (n, 1), untouched rows = fill
            return x if in_order else x.new_full((n, 1), fill).index_copy_(0, ids, x)

        m = exp_avg.lerp_(full_grad, 1 - b1)
        v = exp_avg_sq.mul_(b2).addcmul_(full_grad, full_grad, value=1 - b2)
        if self.weight_decay:
            weight.mul_(per_row(decay, 1.0))
        denom = torch.sqrt(v, out=buf_d).add_(per_row(eps_r, 1.0))
        weight.addcdiv_(torch.mul(m, per_row(neg_step, 0.0), out=buf_m), denom)
        for t, k in zip((weight, exp_avg, exp_avg_sq), kept):
            t.index_copy_(0, untouched, k)

    def _row_factors(self, st: dict, ids: torch.Tensor, n: torch.Tensor, device) -> tuple[torch.Tensor, ...]:
        """Per-row ``(decay, -step, eps)`` factors ``(U, 1)`` fp32 of this step, from which
        ``w <- w·decay + (-step)·m / (sqrt(v) + eps)``. The bias corrections are folded in:
        lr/bc1 · m / (sqrt(v)/sqrt(bc2) + eps) == (lr·sqrt(bc2)/bc1) · m / (sqrt(v) + eps·sqrt(bc2)),
        which saves two passes over the rows. Records this step as the rows' last update."""
        b1, b2 = self.betas
        decay = torch.ones(len(ids), 1, dtype=torch.float64, device=device)
        if self.weight_decay:
            decay.fill_(1 - self.lr * self.weight_decay)
            if self.decay_untouched == "catchup":  # steps since the last update, this one included
                decay = decay.pow((self.global_step - st["last_step"].index_select(0, ids)).to(torch.float64)[:, None])
        st["last_step"].index_fill_(0, ids, self.global_step)
        n64 = n.to(torch.float64)[:, None]  # (U, 1) per-row update count
        bc2_sqrt = (1 - b2 ** n64).sqrt()
        neg_step = -self.lr * bc2_sqrt / (1 - b1 ** n64)
        return tuple(x.to(torch.float32) for x in (decay, neg_step, self.eps * bc2_sqrt))

    def _update_compiled(self, name: str, table, st: dict, ids, grad, decay, neg_step, eps_r) -> bool:
        """The row update as one compiled kernel; False (and eager from now on) if compiling fails."""
        global _compiled_row_update
        try:
            if _compiled_row_update is None:
                _compiled_row_update = torch.compile(_row_update, dynamic=True)
            _compiled_row_update(table.weight.data, st["exp_avg"], st["exp_avg_sq"], ids, grad, decay, neg_step,
                                 eps_r, *self._workspace(name, len(ids), grad), *self.betas)
            return True
        except Exception as e:  # no C++ compiler, unsupported device, ...: the eager path is exact too
            first = str(e).splitlines()[0] if str(e) else ""
            warnings.warn(f"SparseRowAdamW(compile=True): compiling the row update failed ({type(e).__name__}: "
                          f"{first}); using the eager update", stacklevel=3)
            self.compile = False
            return False

    def _workspace(self, name: str, rows: int, like: torch.Tensor) -> list[torch.Tensor]:
        """Three ``(rows, dim)`` scratch tensors kept across steps (grown when a step needs more)."""
        bufs = self._buffers.get(name)
        if bufs is None or bufs[0].shape[0] < rows or bufs[0].device != like.device:
            bufs = [torch.empty(max(rows, 1), like.shape[1], dtype=torch.float32, device=like.device) for _ in range(3)]
            self._buffers[name] = bufs
        return [b[:rows] for b in bufs]

    def _state_of(self, name: str, table) -> dict[str, torch.Tensor]:
        if name not in self.state:
            dev = table_device(table)
            self.state[name] = {
                "exp_avg": torch.zeros(table.num_rows, table.dim, device=dev),
                "exp_avg_sq": torch.zeros(table.num_rows, table.dim, device=dev),
                "step": torch.zeros(table.num_rows, dtype=torch.int64, device=dev),
                "last_step": torch.zeros(table.num_rows, dtype=torch.int64, device=dev),
            }
        return self.state[name]

    # -- checkpointing --------------------------------------------------------------------
    def state_dict(self) -> tuple[dict[str, torch.Tensor], dict]:
        """``(tensors, scalars)``: tensors keyed ``"<table>.<name>"`` (safetensors), scalars as json."""
        return table_state_dict(self)

    def load_state_dict(self, tensors: Mapping[str, torch.Tensor], meta: dict) -> None:
        """Restore moments, per-row counters, global step and hyperparameters (as torch optimizers do)."""
        load_scalars(self, meta)
        self.state = {}
        for name in meta["tables"]:
            if name not in self.tables:
                raise ValueError(f"optimizer state has table {name!r} but the model has tables {sorted(self.tables)}")
            table = self.tables[name]
            st = self._state_of(name, table)
            for key, ref in st.items():
                src = tensors[f"{name}.{key}"]
                if src.shape != ref.shape:
                    raise ValueError(f"optimizer state {name}.{key} has shape {tuple(src.shape)}, table expects {tuple(ref.shape)}")
                ref.copy_(src)

    def parameters(self) -> list[torch.nn.Parameter]:
        """In-memory parameters of the tables (for the coverage check of the param groups)."""
        return [p for t in self.tables.values() if isinstance(t, torch.nn.Module) for p in t.parameters()]
