"""The row AdamW of the fused table path: one update over the touched rows of every table.

``adamw_math_`` is the update of ``stemlm.train.sparse_adam`` written once, with the same
operations in the same order (so the eager fused path equals the reference bit for bit);
``indexed_update_`` applies it to rows picked by an index from stacked ``(rows, dim)`` state
(gather, update, masked write-back), ``window_update_`` to a compact window of rows in place.
Either runs eager or as one ``torch.compile``-d function: on CUDA inductor turns it into Triton
kernels, on the CPU into OpenMP C++ loops (``compiled``). On the CPU the optimizer uses the
hand-written loop of ``cpu_kernel.py`` instead where it can be built (one pass over the rows where
inductor needs two, the factors computed per row inside it). The per-row factors (bias corrections,
catch-up decay) are computed by ``row_factors`` on ``(n, P)`` counters: tiny tensors, eager.
"""

from __future__ import annotations

import warnings

import torch


def row_factors(step: torch.Tensor, last: torch.Tensor, lr: float, weight_decay: float, global_step: int,
                betas: tuple[float, float], eps: float, catchup: bool) -> tuple[torch.Tensor, ...]:
    """``(n, decay, neg_step, eps_r)`` for rows with update counts ``step`` and last updates ``last``
    (shape ``S``): ``n = step + 1`` and three fp32 factors ``S + (1,)`` computed in fp64 as
    ``SparseRowAdamW._row_factors`` computes them, so ``w <- w·decay + neg_step·m / (sqrt(v) + eps_r)``."""
    b1, b2 = betas  # lr and global_step: numbers, or 0-d device tensors (a captured step)
    n = step + 1
    decay = torch.ones(n.shape + (1,), dtype=torch.float64, device=n.device)
    if weight_decay:
        decay.fill_(1 - lr * weight_decay)
        if catchup:  # steps since the last update, this one included
            decay = decay.pow((global_step - last).to(torch.float64)[..., None])
    n64 = n.to(torch.float64)[..., None]
    bc2_sqrt = (1 - b2 ** n64).sqrt()
    neg_step = -lr * bc2_sqrt / (1 - b1 ** n64)
    return (n, *(x.to(torch.float32) for x in (decay, neg_step, eps * bc2_sqrt)))


def adamw_math_(w, m, v, g, decay, neg_step, eps_r, b1: float, b2: float) -> None:
    """AdamW on rows ``w``, moments ``m``, ``v`` in place, given gradients ``g`` (all ``(..., dim)``)."""
    m.lerp_(g, 1 - b1)
    v.mul_(b2).addcmul_(g, g, value=1 - b2)
    w.mul_(decay)
    w.addcdiv_(torch.mul(m, neg_step), torch.sqrt(v).add_(eps_r))


def indexed_update_(weight, exp_avg, exp_avg_sq, flat, w_rows, g, decay, neg_step, eps_r, valid,
                    b1: float, b2: float) -> None:
    """Rows ``flat (K,)`` of ``weight``/``exp_avg``/``exp_avg_sq`` (each ``(R, dim)``) updated from
    ``w_rows`` (their current values, ``(K, dim)``, overwritten) and gradients ``g (K, dim)``.

    ``valid (K, 1)`` (or None) marks the rows to update; the others are written back unchanged
    (padded slots of a static-shape step). ``flat`` must not repeat an index.
    """
    m = exp_avg.index_select(0, flat)  # (K, dim)
    v = exp_avg_sq.index_select(0, flat)
    w = w_rows
    if valid is not None:
        m0, v0, w0 = m.clone(), v.clone(), w.clone()
    adamw_math_(w, m, v, g, decay, neg_step, eps_r, b1, b2)
    if valid is not None:
        m, v, w = torch.where(valid, m, m0), torch.where(valid, v, v0), torch.where(valid, w, w0)
    exp_avg.index_copy_(0, flat, m)
    exp_avg_sq.index_copy_(0, flat, v)
    weight.index_copy_(0, flat, w)


def window_update_(w, m, v, g, decay, neg_step, eps_r, b1: float, b2: float) -> None:
    """``adamw_math_`` on a compact window of rows (every row valid), in place."""
    adamw_math_(w, m, v, g, decay, neg_step, eps_r, b1, b2)


class Kernel:
    """One of the update functions, eager or compiled once per process (``dynamic=True``: the
    number of rows changes from step to step on the exact path). A compile failure (no C++
    compiler, an unsupported device) warns once and falls back to the eager function."""

    _compiled: dict = {}

    def __init__(self, fn, compiled: bool):
        self.fn, self.compiled = fn, compiled

    def __call__(self, *args) -> None:
        if self.compiled:
            try:
                fn = Kernel._compiled.get(self.fn.__name__)
                if fn is None:
                    fn = Kernel._compiled[self.fn.__name__] = torch.compile(self.fn, dynamic=True)
                return fn(*args)
            except Exception as e:  # the eager function computes the same update
                first = str(e).splitlines()[0] if str(e) else ""
                warnings.warn(f"fused table path: compiling {self.fn.__name__} failed ({type(e).__name__}: {first}); "
                              "using the eager update", stacklevel=2)
                self.compiled = False
        return self.fn(*args)
