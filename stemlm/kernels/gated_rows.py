"""``SiLU(g) ⊙ U[t]`` with the rows read where they are, and its backward as a segmented sum.

Forward (``gated_rows``): for every position ``i`` of a micro-batch (``N`` of them), the gate's
pre-activation ``g (N, F)`` and the step's rows ``R (P, F)`` (fp32, one per distinct id) give

    h[i] = SiLU(g[i]) ⊙ R[inverse[i]]                                     (N, F), in g's dtype

in one pass: the row is gathered inside the kernel, so no ``(N, F)`` fp32 copy of the rows is
made and nothing is cast outside it. The reference path computes ``F.silu(g) * R[inverse]``.

Backward, from ``dh (N, F)``:

    dg[i]   = dh[i] ⊙ R[s] ⊙ SiLU'(g[i])           with s = inverse[i]
    dR[s]  += Σ_{i : inverse[i] = s} dh[i] ⊙ SiLU(g[i])

The positions are sorted by slot once per micro-batch (``Segments``, shared by every layer), so
each slot's positions are one contiguous segment. Pass 1 takes tiles of ``CHUNK`` sorted positions ×
``BLOCK_F`` columns: it writes ``dg`` and sums each segment's part inside the tile with a segmented
scan in registers, storing the partial sum at the segment's last position in that tile (a scratch
row). Pass 2 gives each block of ``BLOCK_S`` slots one program that adds their partials (one per
tile a segment touches) into the row gradients, leaving slots the micro-batch does not use
untouched. A hot row (`` the`` may own hundreds of positions) is thus split across tiles instead of
serialising one program, and no fp32 atomics are used: the result is deterministic.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from . import configs  # the tile sizes and warps of each kernel (configs.DEFAULTS, tunable on the GPU)


@dataclass
class Segments:
    """The positions of a micro-batch grouped by slot: ``order (N,)`` positions sorted by slot
    (stable), ``sorted_slot (N,)`` their slots, ``starts (P + 1,)`` where each slot's segment begins.
    Static shapes, no host sync."""

    order: torch.Tensor
    sorted_slot: torch.Tensor
    starts: torch.Tensor

    @classmethod
    def of(cls, inverse: torch.Tensor, num_slots: int) -> "Segments":
        """Sort ``inverse (N,)`` (slot of every position, values in ``[0, num_slots)``) once."""
        inverse = inverse.reshape(-1)
        sorted_slot, order = torch.sort(inverse, stable=True)  # (N,) each
        starts = torch.searchsorted(sorted_slot, torch.arange(num_slots + 1, device=inverse.device,
                                                              dtype=sorted_slot.dtype))  # (P + 1,)
        return cls(order.contiguous(), sorted_slot.contiguous(), starts.contiguous())


@triton.jit
def _sigmoid(x):
    # written out: tl.sigmoid is a jit function of Triton's standard library, which the interpreter
    # runs only when TRITON_INTERPRET was set before triton was first imported
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def _forward_kernel(g_ptr, rows_ptr, inv_ptr, h_ptr, N, F, BLOCK_N: tl.constexpr, BLOCK_F: tl.constexpr):
    pos = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    pmask, cmask = pos < N, cols < F
    mask = pmask[:, None] & cmask[None, :]
    slot = tl.load(inv_ptr + pos, mask=pmask, other=0).to(tl.int64)
    at = pos.to(tl.int64)[:, None] * F + cols[None, :]
    g = tl.load(g_ptr + at, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(rows_ptr + slot[:, None] * F + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    h = g * _sigmoid(g) * r
    tl.store(h_ptr + at, h.to(h_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _segment_add(v1, f1, v2, f2):
    # combine of a segmented inclusive scan: a position that starts a segment drops what came before
    return tl.where(f2 != 0, v2, v1 + v2), f1 | f2


@triton.jit
def _backward_tile(dh, g_ptr, rows_ptr, slot_ptr, dg_ptr, part_ptr, i, pos, cols, live, cmask, start, N, F,
                   CHUNK: tl.constexpr, COLS: tl.constexpr):
    # pass 1 on one tile, given its upstream gradient dh (CHUNK sorted positions i at positions pos x columns,
    # fp32): writes dg and each segment's partial row gradient at its last position in the tile. Shared by
    # _backward_tiles_kernel and the down projection's backward GEMM (gated_gemm.py), whose epilogue it is.
    slot = tl.load(slot_ptr + i, mask=live, other=-1)
    prev = tl.load(slot_ptr + i - 1, mask=live & (i > start), other=-2)  # the tile's first row starts a segment
    nxt = tl.load(slot_ptr + i + 1, mask=(i + 1 < N) & (i + 1 < start + CHUNK), other=-3)
    seg_start = slot != prev
    seg_end = live & (slot != nxt)  # the last position of a segment inside this tile
    m = live[:, None] & cmask[None, :]
    at = pos[:, None] * F + cols[None, :]  # (CHUNK, BLOCK_F)
    g = tl.load(g_ptr + at, mask=m, other=0.0).to(tl.float32)
    r = tl.load(rows_ptr + tl.maximum(slot, 0).to(tl.int64)[:, None] * F + cols[None, :], mask=m,
                other=0.0).to(tl.float32)
    sig = _sigmoid(g)
    tl.store(dg_ptr + at, (dh * r * (sig * (1.0 + g * (1.0 - sig)))).to(dg_ptr.dtype.element_ty), mask=m)
    flags = tl.broadcast_to(seg_start.to(tl.int32)[:, None], (CHUNK, COLS))
    run, _ = tl.associative_scan((dh * (g * sig), flags), 0, _segment_add)  # sums from each segment's start
    tl.store(part_ptr + i.to(tl.int64)[:, None] * F + cols[None, :], run, mask=seg_end[:, None] & cmask[None, :])


@triton.jit
def _backward_tiles_kernel(dh_ptr, g_ptr, rows_ptr, order_ptr, slot_ptr, dg_ptr, part_ptr, N, F,
                           CHUNK: tl.constexpr, BLOCK_F: tl.constexpr):
    start = tl.program_id(0) * CHUNK
    i = start + tl.arange(0, CHUNK)  # (CHUNK,) sorted positions of this tile
    cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    live, cmask = i < N, cols < F
    pos = tl.load(order_ptr + i, mask=live, other=0).to(tl.int64)
    dh = tl.load(dh_ptr + pos[:, None] * F + cols[None, :], mask=live[:, None] & cmask[None, :], other=0.0)
    _backward_tile(dh.to(tl.float32), g_ptr, rows_ptr, slot_ptr, dg_ptr, part_ptr, i, pos, cols, live, cmask,
                   start, N, F, CHUNK, BLOCK_F)


@triton.jit
def _backward_rows_kernel(part_ptr, starts_ptr, grad_ptr, P, F, CHUNK: tl.constexpr, BLOCK_S: tl.constexpr,
                          BLOCK_F: tl.constexpr):
    s = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)  # (BLOCK_S,) slots
    cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    smask, cmask = s < P, cols < F
    a = tl.load(starts_ptr + s, mask=smask, other=0)
    b = tl.load(starts_ptr + s + 1, mask=smask, other=0)
    first = a // CHUNK  # the tiles a segment touches: first .. (b - 1) // CHUNK, its partial at the last
    n_tiles = tl.where(a < b, (b - 1) // CHUNK - first + 1, 0)  # position it has in each
    acc = tl.zeros((BLOCK_S, BLOCK_F), dtype=tl.float32)
    most = tl.max(n_tiles, 0)
    j = 0
    while j < most:  # (a while loop: the interpreter cannot take tensor bounds in range())
        last = tl.minimum(b - 1, (first + j + 1) * CHUNK - 1)
        m = (j < n_tiles)[:, None] & cmask[None, :]
        acc += tl.load(part_ptr + last.to(tl.int64)[:, None] * F + cols[None, :], mask=m, other=0.0)
        j += 1
    at = s.to(tl.int64)[:, None] * F + cols[None, :]
    m = (smask & (a < b))[:, None] & cmask[None, :]  # slots this micro-batch does not use stay untouched
    tl.store(grad_ptr + at, tl.load(grad_ptr + at, mask=m, other=0.0) + acc, mask=m)


def gated_rows_forward(g: torch.Tensor, rows: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """``SiLU(g) ⊙ rows[inverse]`` for ``g (N, F)``, ``rows (P, F)``, ``inverse (N,)`` -> ``(N, F)`` in g's dtype."""
    N, F_ = g.shape
    h = torch.empty_like(g)
    if N:
        c, warps = configs.launch("forward")
        _forward_kernel[(triton.cdiv(N, c["BLOCK_N"]), triton.cdiv(F_, c["BLOCK_F"]))](
            g, rows, inverse, h, N, F_, **c, num_warps=warps)
    return h


def gated_rows_backward(dh: torch.Tensor, g: torch.Tensor, rows: torch.Tensor, seg: Segments,
                        row_grad: torch.Tensor) -> torch.Tensor:
    """The gate's gradient ``(N, F)``; every row's gradient is added into ``row_grad (P, F)`` fp32."""
    N, F_ = g.shape
    dg = torch.empty_like(g)
    if N == 0:
        return dg
    part = torch.empty(N, F_, dtype=torch.float32, device=g.device)  # partial sums at segment ends, per tile
    t, t_warps = configs.launch("backward_tiles")
    _backward_tiles_kernel[(triton.cdiv(N, t["CHUNK"]), triton.cdiv(F_, t["BLOCK_F"]))](
        dh, g, rows, seg.order, seg.sorted_slot, dg, part, N, F_, **t, num_warps=t_warps)
    add_partials(part, seg, row_grad, t["CHUNK"])
    return dg


def add_partials(part: torch.Tensor, seg: Segments, row_grad: torch.Tensor, chunk: int) -> None:
    """Pass 2: add each slot's partial sums (``part (N, F)``, at its segment's last position in every tile of
    ``chunk`` sorted positions) into ``row_grad (P, F)``; slots no position uses stay untouched."""
    P, F_ = row_grad.shape
    r, r_warps = configs.launch("backward_rows")
    _backward_rows_kernel[(triton.cdiv(P, r["BLOCK_S"]), triton.cdiv(F_, r["BLOCK_F"]))](
        part, seg.starts, row_grad, P, F_, CHUNK=chunk, **r, num_warps=r_warps)


class GatedRows(torch.autograd.Function):
    """Autograd of ``gated_rows``: the gate gets its gradient back; the rows' gradient goes
    straight into the step's row-gradient buffer (``row_grad``), not through autograd."""

    @staticmethod
    def forward(ctx, g, rows, inverse, seg, row_grad):
        shape = g.shape
        g2 = g.reshape(-1, shape[-1]).contiguous()  # (N, F)
        ctx.save_for_backward(g2, rows, inverse)
        ctx.seg, ctx.row_grad, ctx.shape = seg, row_grad, shape
        return gated_rows_forward(g2, rows, inverse).view(shape)

    @staticmethod
    def backward(ctx, dh):
        g2, rows, inverse = ctx.saved_tensors
        dh2 = dh.reshape(g2.shape).contiguous()
        dg = gated_rows_backward(dh2, g2, rows, ctx.seg, ctx.row_grad)
        return dg.view(ctx.shape), None, None, None, None


def gated_rows(g: torch.Tensor, rows: torch.Tensor, inverse: torch.Tensor, seg: Segments,
               row_grad: torch.Tensor) -> torch.Tensor:
    """``SiLU(g) ⊙ rows[inverse]`` for ``g (..., F)`` (``inverse`` over its leading positions);
    under autograd the rows' gradient is added into ``row_grad (P, F)``."""
    return GatedRows.apply(g, rows, inverse.reshape(-1), seg, row_grad)


def gated_rows_reference(g: torch.Tensor, rows: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """What the reference path computes: ``F.silu(g) * rows[inverse]`` (shape of ``g``)."""
    return F.silu(g) * rows.index_select(0, inverse.reshape(-1)).view(g.shape)
