"""The fused path's row AdamW as one memory-bound Triton pass over the touched rows.

For each touched row ``k`` (flat index ``flat[k]`` into stacked ``(R, D)`` state) and valid slot:

    m <- m + (1 - β1)(g - m);   v <- β2 v + (1 - β2) g²;   w <- w · decay + (neg_step · m) / (√v + eps_r)

with the per-row factors ``decay``, ``neg_step``, ``eps_r`` of ``stemlm.row_adam.row_factors``
(the same operations in the same order as ``adamw_math_``). Each program reads the row's weight,
gradient and moments once and writes weight and moments once: 4 reads and 3 writes of ``D`` fp32
per row, the whole cost of the update. Invalid (padded) slots are not written at all, which is what
the reference's masked write-back of unchanged values amounts to.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import configs  # BLOCK_D and warps (configs.DEFAULTS["row_adamw"], tunable on the GPU)


@triton.jit
def _row_adamw_kernel(w_ptr, m_ptr, v_ptr, flat_ptr, w_rows_ptr, g_ptr, decay_ptr, neg_step_ptr, eps_ptr, valid_ptr,
                      D, b1, b2, HAS_VALID: tl.constexpr, BLOCK_D: tl.constexpr):
    k = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = cols < D
    if HAS_VALID:
        # the flag broadcast over the block before the comparison: Triton 3.9's interpreter types a block mask
        # `&` a scalar comparison as int32, which tl.load then refuses
        mask = mask & ((cols * 0 + tl.load(valid_ptr + k)) != 0)
    row = tl.load(flat_ptr + k).to(tl.int64) * D
    own = k.to(tl.int64) * D
    w = tl.load(w_rows_ptr + own + cols, mask=mask, other=0.0)
    g = tl.load(g_ptr + own + cols, mask=mask, other=0.0)
    m = tl.load(m_ptr + row + cols, mask=mask, other=0.0)
    v = tl.load(v_ptr + row + cols, mask=mask, other=0.0)
    decay = tl.load(decay_ptr + k)
    neg_step = tl.load(neg_step_ptr + k)
    eps_r = tl.load(eps_ptr + k)
    m = m + (1.0 - b1) * (g - m)
    v = v * b2 + (1.0 - b2) * (g * g)
    w = w * decay + (m * neg_step) / (tl.sqrt(v) + eps_r)
    tl.store(m_ptr + row + cols, m, mask=mask)
    tl.store(v_ptr + row + cols, v, mask=mask)
    tl.store(w_ptr + row + cols, w, mask=mask)


def row_adamw_(weight, exp_avg, exp_avg_sq, flat, w_rows, g, decay, neg_step, eps_r, valid,
               b1: float, b2: float) -> None:
    """In place on rows ``flat (K,)`` of ``weight``/``exp_avg``/``exp_avg_sq`` (each ``(R, D)`` fp32),
    from the rows' current values ``w_rows (K, D)`` and gradients ``g (K, D)``; factors ``(K, 1)``;
    ``valid (K, 1)`` bool or None. Same arguments as ``stemlm.train.fused.kernels.indexed_update_``."""
    K, D = g.shape
    if K == 0:
        return
    w_rows, g = w_rows.contiguous(), g.contiguous()
    valid_arg = valid.reshape(-1).to(torch.int8).contiguous() if valid is not None else flat
    c, warps = configs.launch("row_adamw")
    _row_adamw_kernel[(K, triton.cdiv(D, c["BLOCK_D"]))](
        weight, exp_avg, exp_avg_sq, flat, w_rows, g, decay.reshape(-1).contiguous(), neg_step.reshape(-1).contiguous(),
        eps_r.reshape(-1).contiguous(), valid_arg, D, b1, b2, HAS_VALID=valid is not None, **c, num_warps=warps)
