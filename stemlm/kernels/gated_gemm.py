"""The STEM FFN with its table work inside the two GEMMs that surround it (``run.table_kernels=triton-gemm``).

A STEM layer computes ``y = W_d (SiLU(W_g x) ⊙ U[t])``. ``gated_rows.py`` runs the row product and its
backward as kernels of their own between cuBLAS GEMMs: the gate's output ``g (N, F)`` and the upstream
gradient ``dh (N, F)`` each make a round trip through memory, and the two kernels cost ~50 + ~63 µs a
layer at the 350M shape on an H200 (docs/gpu.md). Here they become the epilogues of the GEMMs:

* **Forward** (``gate_gemm``): a Triton GEMM computes ``g = x W_gᵀ`` tile by tile and, while the tile is
  in registers, gathers the rows ``U[t]`` of its positions (fp32, from the step's distinct rows by slot)
  and writes ``h = SiLU(g) ⊙ U[t]`` beside ``g`` (kept for backward). cuBLAS computes ``y = h W_dᵀ``.
* **Backward** (``down_backward``): a Triton GEMM computes ``dh = dy W_d`` over the positions *sorted by
  slot* (its A rows read through ``Segments.order``), and its epilogue is pass 1 of the segmented
  backward (``gated_rows._backward_tile``): the gate's gradient ``dg`` at every position and each
  segment's partial row gradient inside the tile. Pass 2 (``gated_rows.add_partials``) adds the partials
  into the step's row gradient. ``dh`` never reaches memory. The other three products (``dW_d = dyᵀ h``,
  ``dx = dg W_g``, ``dW_g = dgᵀ x``) stay cuBLAS's.

Numerics: ``g`` and ``dh`` are rounded to the activations' dtype before the epilogue uses them, which is
what the unfused path's GEMMs hand on; only the GEMMs' summation order differs. The row gradient is
deterministic (no atomics): its partial sums are cut every ``BLOCK_M`` sorted positions.
Tile sizes come from ``configs`` (``gate_gemm``, ``down_backward``; tuned by ``gpu_checks.py --tune``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import configs
from .gated_rows import Segments, _backward_tile, _sigmoid, add_partials, gated_rows_reference


@triton.jit
def _tile_of_program(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    # grouped order: GROUP_M row tiles share the column tiles of W while they are in L2. (No tl.cdiv here or
    # below: it is a jit function of Triton's standard library, which the interpreter runs only when
    # TRITON_INTERPRET was set before triton was first imported.)
    pid = tl.program_id(0)
    per_group = GROUP_M * ((N + BLOCK_N - 1) // BLOCK_N)
    first_m = (pid // per_group) * GROUP_M
    size_m = tl.minimum((M + BLOCK_M - 1) // BLOCK_M - first_m, GROUP_M)
    return first_m + (pid % per_group) % size_m, (pid % per_group) // size_m


@triton.jit
def _dot_loop(a_ptrs, b_ptrs, a_step, b_step, rk, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    # the fp32 product of a (BLOCK_M, D) and a (D, BLOCK_N) operand, BLOCK_K at a time (the pointers' steps given)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, (D + BLOCK_K - 1) // BLOCK_K):
        if D % BLOCK_K == 0:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            kmask = rk + k * BLOCK_K < D
            a = tl.load(a_ptrs, mask=kmask[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=kmask[:, None], other=0.0)
        if UPCAST:  # the Triton interpreter multiplies bf16 as raw integers: give it fp32 (same values)
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        a_ptrs += a_step
        b_ptrs += b_step
    return acc


@triton.jit
def _gate_gemm_kernel(x_ptr, w_ptr, rows_ptr, inv_ptr, g_ptr, h_ptr, N, F, D: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                      PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    pid_m, pid_n = _tile_of_program(N, F, BLOCK_M, BLOCK_N, GROUP_M)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # positions
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # columns of d_ff
    rk = tl.arange(0, BLOCK_K)
    mmask, nmask = rm < N, rn < F
    # rows past N and columns past F read wrapped-around rows (valid memory, results never stored): no masks
    # in the K loop but the tail's, and none at all when BLOCK_K divides D
    a_ptrs = x_ptr + (rm % N).to(tl.int64)[:, None] * D + rk[None, :]  # (BLOCK_M, BLOCK_K) of x (N, D)
    b_ptrs = w_ptr + (rn % F).to(tl.int64)[None, :] * D + rk[:, None]  # (BLOCK_K, BLOCK_N) of W_gᵀ, W_g (F, D)
    acc = _dot_loop(a_ptrs, b_ptrs, BLOCK_K, BLOCK_K, rk, D, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION, UPCAST)
    m = mmask[:, None] & nmask[None, :]
    at = rm.to(tl.int64)[:, None] * F + rn[None, :]
    g = acc.to(g_ptr.dtype.element_ty)  # what a GEMM writing g hands on
    tl.store(g_ptr + at, g, mask=m)
    slot = tl.load(inv_ptr + rm, mask=mmask, other=0).to(tl.int64)
    r = tl.load(rows_ptr + slot[:, None] * F + rn[None, :], mask=m, other=0.0).to(tl.float32)
    gf = g.to(tl.float32)
    tl.store(h_ptr + at, (gf * _sigmoid(gf) * r).to(h_ptr.dtype.element_ty), mask=m)


@triton.jit
def _down_backward_kernel(dy_ptr, w_ptr, g_ptr, rows_ptr, order_ptr, slot_ptr, dg_ptr, part_ptr, N, F, D: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          GROUP_M: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    pid_m, pid_n = _tile_of_program(N, F, BLOCK_M, BLOCK_N, GROUP_M)
    start = pid_m * BLOCK_M
    i = start + tl.arange(0, BLOCK_M)  # sorted positions of this tile
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    live, nmask = i < N, rn < F
    pos = tl.load(order_ptr + i, mask=live, other=0).to(tl.int64)
    a_ptrs = dy_ptr + pos[:, None] * D + rk[None, :]  # (BLOCK_M, BLOCK_K): rows of dy (N, D) in slot order
    b_ptrs = w_ptr + rk.to(tl.int64)[:, None] * F + (rn % F)[None, :]  # (BLOCK_K, BLOCK_N) of W_d (D, F)
    acc = _dot_loop(a_ptrs, b_ptrs, BLOCK_K, BLOCK_K * F, rk, D, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION, UPCAST)
    dh = acc.to(dy_ptr.dtype.element_ty).to(tl.float32)  # what a GEMM writing dh hands on
    _backward_tile(dh, g_ptr, rows_ptr, slot_ptr, dg_ptr, part_ptr, i, pos, rn, live, nmask, start, N, F,
                   BLOCK_M, BLOCK_N)


def _dot_options(t: torch.Tensor) -> dict:
    """``tl.dot``'s settings for operands like ``t``: IEEE fp32 products unless torch allows TF32 (fp32
    operands only); under the Triton interpreter (CPU tensors) bf16/fp16 operands are widened to fp32 first."""
    tf32 = t.is_cuda and torch.backends.cuda.matmul.allow_tf32
    return {"PRECISION": "tf32" if t.dtype != torch.float32 or tf32 else "ieee",
            "UPCAST": not t.is_cuda and t.dtype != torch.float32}


def _grid(N: int, F_: int, c: dict) -> tuple[int]:
    return (triton.cdiv(N, c["BLOCK_M"]) * triton.cdiv(F_, c["BLOCK_N"]),)


def gate_gemm(x: torch.Tensor, w_gate: torch.Tensor, rows: torch.Tensor, inverse: torch.Tensor):
    """``(g, h)``: ``g = x W_gᵀ`` and ``h = SiLU(g) ⊙ rows[inverse]``, each ``(N, F)`` in x's dtype, for
    ``x (N, D)``, ``w_gate (F, D)`` (x's dtype), ``rows (P, F)`` fp32, ``inverse (N,)``."""
    N, D = x.shape
    F_ = w_gate.shape[0]
    g = torch.empty(N, F_, dtype=x.dtype, device=x.device)
    h = torch.empty_like(g)
    if N:
        c, opts = configs.launch_options("gate_gemm")
        _gate_gemm_kernel[_grid(N, F_, c)](x, w_gate, rows, inverse, g, h, N, F_, D, **c,
                                           **_dot_options(x), **opts)
    return g, h


def down_backward(dy: torch.Tensor, w_down: torch.Tensor, g: torch.Tensor, rows: torch.Tensor, seg: Segments,
                  row_grad: torch.Tensor) -> torch.Tensor:
    """The gate's gradient ``dg (N, F)`` from ``dy (N, D)`` and ``w_down (D, F)`` through ``dh = dy W_d``
    (never stored); every row's gradient is added into ``row_grad (P, F)`` fp32."""
    N, D = dy.shape
    F_ = w_down.shape[1]
    dg = torch.empty_like(g)
    if N == 0:
        return dg
    part = torch.empty(N, F_, dtype=torch.float32, device=g.device)  # partial sums at segment ends, per tile
    c, opts = configs.launch_options("down_backward")
    _down_backward_kernel[_grid(N, F_, c)](dy, w_down, g, rows, seg.order, seg.sorted_slot, dg, part, N, F_, D,
                                           **c, **_dot_options(dy), **opts)
    add_partials(part, seg, row_grad, c["BLOCK_M"])  # pass 2, as gated_rows runs it
    return dg


class GatedFFN(torch.autograd.Function):
    """Autograd of the fused STEM FFN ``y = (SiLU(x W_gᵀ) ⊙ rows[inverse]) W_dᵀ``: x and both weights get
    their gradients back; the rows' gradient goes into ``row_grad`` (not through autograd)."""

    @staticmethod
    def forward(ctx, x, w_gate, w_down, rows, inverse, seg, row_grad):
        g, h = gate_gemm(x, w_gate, rows, inverse)
        ctx.save_for_backward(x, w_gate, w_down, rows, g, h)
        ctx.seg, ctx.row_grad = seg, row_grad
        return h @ w_down.t()  # (N, D)

    @staticmethod
    def backward(ctx, dy):
        x, w_gate, w_down, rows, g, h = ctx.saved_tensors
        dy = dy.contiguous()
        dg = down_backward(dy, w_down, g, rows, ctx.seg, ctx.row_grad)
        dx = dg @ w_gate if ctx.needs_input_grad[0] else None  # (N, D)
        dw_gate = dg.t() @ x if ctx.needs_input_grad[1] else None  # (F, D)
        dw_down = dy.t() @ h if ctx.needs_input_grad[2] else None  # (D, F)
        return dx, dw_gate, dw_down, None, None, None, None


def gated_ffn(x: torch.Tensor, w_gate: torch.Tensor, w_down: torch.Tensor, rows: torch.Tensor,
              inverse: torch.Tensor, seg: Segments, row_grad: torch.Tensor) -> torch.Tensor:
    """``W_d (SiLU(W_g x) ⊙ rows[inverse])`` for ``x (..., D)``, ``w_gate (F, D)``, ``w_down (D, F)``
    (fp32 masters: cast to the autocast dtype when autocast is on, as ``F.linear`` would), ``rows (P, F)``;
    under autograd the rows' gradient is added into ``row_grad (P, F)``. Returns ``(..., D)``."""
    kind = x.device.type
    dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype
    x2 = x.reshape(-1, x.shape[-1]).to(dtype).contiguous()  # (N, D)
    with torch.autocast(kind, enabled=False):
        y = GatedFFN.apply(x2, w_gate.to(dtype).contiguous(), w_down.to(dtype).contiguous(), rows,
                           inverse.reshape(-1), seg, row_grad)
    return y.view(*x.shape[:-1], y.shape[-1])


def gated_ffn_reference(x, w_gate, w_down, rows, inverse):
    """What the unfused path computes: ``(SiLU(x W_gᵀ) ⊙ rows[inverse]) W_dᵀ`` (shape of ``x``)."""
    return gated_rows_reference(x @ w_gate.t(), rows, inverse) @ w_down.t()
