"""How a layer's table rows reach its FFN: a tensor per position, or ``IndexedRows``.

The fused table path with ``run.table_kernels=triton`` (or ``triton-gemm``) hands each table layer its
step's distinct rows and an index instead of one row per position; a kind that fuses the gather into its
product (``FFNKind.fuses_row_gather``) consumes them as they are, every other kind sees ``as_rows(rows)``.
"""

from __future__ import annotations

import torch


class IndexedRows:
    """One layer's rows as the step's distinct rows plus an index, not expanded per position.

    ``rows (P, dim)`` are the rows of the step's distinct ids, ``inverse (N,)`` the slot of every
    position of a batch of shape ``shape``, ``segments`` the positions sorted by slot (shared by
    every layer of the micro-batch) and ``grad (P, dim)`` fp32 the buffer that the rows' gradient is
    added into (the gradient is handed over there, not through autograd). A kind that fuses the
    gather into its product (``FFNKind.fuses_row_gather``: STEM) calls ``gated``, or ``gated_ffn`` for the
    whole layer when ``fuses_gemms`` (``run.table_kernels=triton-gemm``: the table work inside the GEMMs'
    epilogues); any other gets ``expand()``, the rows at every position. Produced by the fused table path
    with ``run.table_kernels=triton`` or ``triton-gemm`` (``stemlm.train.fused``).
    """

    def __init__(self, rows: torch.Tensor, inverse: torch.Tensor, shape: torch.Size, segments, grad: torch.Tensor,
                 kernels, gemm_kernels=None):
        self.rows, self.inverse, self.shape, self.segments, self.grad = rows, inverse, shape, segments, grad
        self.kernels = kernels  # the module holding gated_rows (stemlm.kernels.gated_rows)
        self.gemm_kernels = gemm_kernels  # stemlm.kernels.gated_gemm, or None

    @property
    def fuses_gemms(self) -> bool:
        """Whether ``gated_ffn`` runs the layer's GEMMs with the table work in their epilogues."""
        return self.gemm_kernels is not None

    def gated_ffn(self, x: torch.Tensor, w_gate: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
        """The whole STEM layer ``W_d (SiLU(W_g x) ⊙ rows[t])`` (``shape + (d,)``) with ``w_gate (d_ff, d)`` and
        ``w_down (d, d_ff)``: the gather inside the gate's GEMM, the row gradient inside the backward's GEMM."""
        return _eager(_gated_ffn)(self, x, w_gate, w_down)

    def gated(self, gate_pre: torch.Tensor) -> torch.Tensor:
        """``SiLU(gate_pre) ⊙ rows[t]`` (``shape + (dim,)``), the row gathered inside the kernel."""
        return _eager(_gated)(self, gate_pre)

    def expand(self) -> torch.Tensor:
        """The rows at every position, ``shape + (dim,)``; their gradient goes into ``grad``."""
        return _eager(_expand)(self)


def _gated(rows: IndexedRows, gate_pre: torch.Tensor) -> torch.Tensor:
    return rows.kernels.gated_rows(gate_pre, rows.rows, rows.inverse, rows.segments, rows.grad)


def _gated_ffn(rows: IndexedRows, x: torch.Tensor, w_gate: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    return rows.gemm_kernels.gated_ffn(x, w_gate, w_down, rows.rows, rows.inverse, rows.segments, rows.grad)


def _expand(rows: IndexedRows) -> torch.Tensor:
    out = _ExpandIndexed.apply(rows.rows, rows.inverse, rows.grad, _anchor())  # (N, dim)
    return out.view(*rows.shape, rows.rows.shape[-1])


_EAGER: dict = {}


def _eager(fn):
    """``fn`` run outside ``torch.compile``: a compiled block breaks its graph there and runs the Triton
    kernels as they are. Wrapped on first use (``torch.compiler.disable`` imports dynamo, which
    ``import stemlm`` must not)."""
    if fn not in _EAGER:
        _EAGER[fn] = torch.compiler.disable(fn)
    return _EAGER[fn]


def _anchor() -> torch.Tensor:
    """An empty tensor that requires grad: it makes autograd call a Function whose other inputs
    need none (the rows' gradient is handed over through a buffer)."""
    return torch.empty(0, requires_grad=True)


def add_rows_(out: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """``out.index_add_(0, index, src)`` in a fixed summation order on every device: on CUDA the sorting
    ``index_put_(accumulate=True)`` (``index_add_`` uses fp32 atomics there, whose order varies)."""
    if out.is_cuda:
        return out.index_put_((index,), src, accumulate=True)
    return out.index_add_(0, index, src)


class _ExpandIndexed(torch.autograd.Function):
    """``rows[inverse]`` whose backward adds into a gradient buffer (``IndexedRows.expand``)."""

    @staticmethod
    def forward(ctx, rows, inverse, grad, anchor):
        ctx.save_for_backward(inverse)
        ctx.grad = grad
        return rows.index_select(0, inverse)  # (N, dim)

    @staticmethod
    def backward(ctx, g):
        (inverse,) = ctx.saved_tensors
        add_rows_(ctx.grad, inverse, g.to(ctx.grad.dtype))
        return None, None, None, None


def as_rows(rows):
    """``rows`` as a tensor ``(..., dim)``: an ``IndexedRows`` is expanded, a tensor is itself."""
    return rows.expand() if isinstance(rows, IndexedRows) else rows
