"""AdamW's arithmetic on table rows that keep their own update counts: the one definition every row optimizer uses.

``row_factors`` turns per-row update counts into the per-row factors of one step (bias corrections, weight decay,
its catch-up), ``adamw_math_`` applies the update to rows and their moments in place, ``indexed_update_`` does
both halves of the gather, update and write-back for rows picked by an index. The training's row optimizers
(``stemlm.train.sparse_adam``, the fused table path ``stemlm.train.fused``, its Triton and C++ kernels, which
follow these formulas operation for operation) and local distillation's lazy row update
(``stemlm.insert.distill``) use them. Plain torch: no package of stemlm below it.
"""

from __future__ import annotations

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
