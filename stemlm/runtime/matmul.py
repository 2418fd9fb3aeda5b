"""Matrix products through oneDNN on CPU (training's ``run.matmul``, ``stemlm generate --matmul``).

ATen's fp32 ``mm``/``linear`` on CPU call the BLAS PyTorch was built with (MKL in the official
wheels); on CPUs MKL does not tune for, oneDNN's JIT kernels, which PyTorch also ships
(``torch.ops.mkldnn._linear_pointwise``), can be much faster. This module routes the forward and
input-gradient GEMMs through oneDNN, and the weight gradient (``grad.T @ x``) too
(``WEIGHT_GRAD``; it was ATen's until 2026-11-28, when an in-process A/B on an AVX-512 CPU,
``benchmarks/bench_weight_grad.py``, measured whole training steps ~8 % faster with it on oneDNN; since
2026-11-29 oneDNN is handed the narrower operand first, see ``weight_grad``).
Measurements: docs/training.md ("GEMMs on CPU") and docs/generation.md.

Applied from outside, like compile and parallelism: ``use_matmul_backend(model, "onednn")`` turns
every ``nn.Linear`` of the model into a ``OneDNNLinear`` (same parameters, same state-dict names);
the class of a linear layer is its backend (``matmul_backend_of``), and the model's chunked loss
asks it of the LM head. A product falls back to
ATen whenever oneDNN does not apply: a non-CPU tensor, a dtype other than float32, or autocast.
The results equal ATen's up to float summation order.

Generation uses it too (``stemlm generate --matmul``), where the products have few rows.
Training's ``run.matmul=auto`` (the default) times both at the run's shapes on this CPU and keeps the
faster (``stemlm.runtime.matmul_probe``): which one wins depends on the CPU.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

BACKENDS = ("auto", "aten", "onednn")


def onednn_available() -> bool:
    """True when this PyTorch build has oneDNN and its dense-tensor linear op."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def bf16_is_fast(device: torch.device) -> bool:
    """Whether bfloat16 GEMMs beat fp32 ones on ``device``: CUDA, or a CPU with native bf16 instructions
    (AVX512-BF16 or AMX, which oneDNN reports); elsewhere bf16 is emulated and slower than fp32."""
    if device.type == "cuda":
        return True
    return device.type == "cpu" and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def resolve_matmul_backend(name: str, device: torch.device | str, dtype: str = "float32") -> str:
    """``aten`` or ``onednn`` for ``run.matmul=name`` on ``device`` with compute ``dtype``.

    ``auto`` picks oneDNN for fp32 on a CPU whose PyTorch has it, ATen otherwise (training narrows that
    CPU case by measuring: ``stemlm.runtime.matmul_probe``).
    """
    if name not in BACKENDS:
        raise ValueError(f"matmul backend must be one of {', '.join(BACKENDS)}, got {name!r}")
    on_cpu = torch.device(device).type == "cpu"
    if name == "onednn":
        if not on_cpu:
            raise ValueError(f"run.matmul=onednn runs on CPU only, but the device is {device}; use auto or aten")
        if not onednn_available():
            raise ValueError("run.matmul=onednn: this PyTorch build has no oneDNN (torch.backends.mkldnn); "
                             "use auto or aten")
        return "onednn"
    if name == "auto" and on_cpu and dtype == "float32" and onednn_available():
        return "onednn"
    return "aten"


def onednn_applies(*tensors: torch.Tensor) -> bool:
    """oneDNN's fp32 path applies to these operands: CPU float32 tensors, autocast off."""
    return (not torch.is_autocast_enabled("cpu")
            and all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors))


def _onednn_nt(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a (M, K) @ b (N, K).T`` by oneDNN (``a`` and ``b`` may be strided views)."""
    if torch.compiler.is_compiling():
        return _onednn_nt_op(a, b)
    return torch.ops.mkldnn._linear_pointwise(a, b, None, "none", [], "")  # eager: no custom-op dispatch


@torch.library.custom_op("stemlm::onednn_mm_nt", mutates_args=())
def _onednn_nt_op(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``_onednn_nt`` as one opaque op for ``torch.compile``: inductor's own lowering of
    ``mkldnn._linear_pointwise`` only accepts frozen (constant) weights."""
    return torch.ops.mkldnn._linear_pointwise(a, b, None, "none", [], "")


@_onednn_nt_op.register_fake
def _(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a.new_empty(a.shape[0], b.shape[0])


def mm_nt(a: torch.Tensor, b: torch.Tensor, backend: str = "aten") -> torch.Tensor:
    """``a (M, K) @ b (N, K).T`` on ``backend`` (falling back to ATen where oneDNN does not apply)."""
    if backend == "onednn" and onednn_applies(a, b):
        return _onednn_nt(a, b)
    return a @ b.t()


def mm_nn(a: torch.Tensor, b: torch.Tensor, backend: str = "aten") -> torch.Tensor:
    """``a (M, K) @ b (K, N)`` on ``backend`` (falling back to ATen where oneDNN does not apply)."""
    if backend == "onednn" and onednn_applies(a, b):
        return _onednn_nt(a, b.t())
    return a @ b


def _linear_nd(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x (..., in) @ weight (out, in).T -> (..., out)`` by oneDNN."""
    return _onednn_nt(x.reshape(-1, x.shape[-1]), weight).view(*x.shape[:-1], weight.shape[0])


WEIGHT_GRADS = ("onednn", "onednn-grad-first", "aten")
WEIGHT_GRAD = "onednn"  # how a OneDNNLinear's weight gradient is computed (``weight_grad``); one of WEIGHT_GRADS


def weight_grad(grad: torch.Tensor, x: torch.Tensor, backend: str = "aten") -> torch.Tensor:
    """The weight gradient ``grad (M, out).T @ x (M, in) -> (out, in)`` on ``backend``.

    oneDNN's product copies its first operand, here a transposed (strided) view, into contiguous rows: a
    pass over ``M × rows`` floats, 3.4 ms of the 5.8 ms product at the tiny preset's 4,096 × 688 × 256
    (``torch.profiler``, 2 cores). With ``WEIGHT_GRAD`` = ``onednn`` (the default) it is given the narrower
    operand: when ``out > in`` (``W_gate`` and ``W_up``, ``d_ff > d``) the product is taken as
    ``(x.T @ grad).T`` and only the small ``(in, out)`` result is transposed back, 3.96 ms instead of 5.83 ms
    for that product (``benchmarks/bench_weight_grad.py`` times whole steps). ``onednn-grad-first`` is the
    product as before 2026-11-29, ``aten`` ATen's ``grad.T @ x``; a backend where oneDNN does not apply is
    ATen's too. The results agree up to float summation order."""
    if backend == "onednn" and WEIGHT_GRAD != "aten" and onednn_applies(grad, x):
        if WEIGHT_GRAD == "onednn" and grad.shape[1] > x.shape[1]:
            return _onednn_nt(x.t(), grad.t()).t().contiguous()  # (in, M) @ (M, out) -> (in, out) -> (out, in)
        return _onednn_nt(grad.t(), x.t())  # (out, M) @ (M, in), transposed views
    return grad.t() @ x


class _OneDNNLinearFn(torch.autograd.Function):
    """``x @ weight.T`` with oneDNN forward, input gradient and weight gradient (``weight_grad``)."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        return _linear_nd(x, weight)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        flat_grad = grad.reshape(-1, grad.shape[-1])  # (M, out)
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = _onednn_nt(flat_grad, weight.t()).view(x.shape)  # (M, out) @ (out, in)
        if ctx.needs_input_grad[1]:
            grad_w = weight_grad(flat_grad, x.reshape(-1, x.shape[-1]), "onednn")  # (out, in)
        return grad_x, grad_w


def onednn_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, weight)`` (no bias) through oneDNN where it applies, ATen otherwise."""
    if not onednn_applies(x, weight) or x.numel() == 0:
        return F.linear(x, weight)
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return _OneDNNLinearFn.apply(x.contiguous(), weight)
    return _linear_nd(x, weight)  # inference: no autograd node


class OneDNNLinear(nn.Linear):
    """An ``nn.Linear`` without bias whose product runs through oneDNN (see ``onednn_linear``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return onednn_linear(x, self.weight)


def matmul_backend_of(linear: nn.Module) -> str:
    """The backend a linear layer's products run on: ``onednn`` for a ``OneDNNLinear``, else ``aten``."""
    return "onednn" if isinstance(linear, OneDNNLinear) else "aten"


def use_matmul_backend(model: nn.Module, backend: str) -> int:
    """Make every bias-free ``nn.Linear`` of ``model`` compute on ``backend`` in place; returns how
    many changed. Parameters, their names and the state dict are untouched; ``aten`` restores."""
    if backend not in ("aten", "onednn"):
        raise ValueError(f"backend must be aten or onednn, got {backend!r}")
    target = OneDNNLinear if backend == "onednn" else nn.Linear
    changed = 0
    for module in model.modules():
        if isinstance(module, nn.Linear) and module.bias is None and type(module) is not target \
                and type(module) in (nn.Linear, OneDNNLinear):
            module.__class__ = target
            changed += 1
    return changed


def apply_matmul(model: nn.Module, name: str, device: torch.device | str = "cpu", dtype: str = "float32") -> str:
    """Resolve ``run.matmul``/``--matmul`` ``name`` for ``device`` and ``dtype`` and apply it to
    ``model`` (``use_matmul_backend``); returns the backend in use, ``aten`` or ``onednn``. Training's
    ``auto`` measures instead (``stemlm.runtime.matmul_probe.apply_training_matmul``)."""
    backend = resolve_matmul_backend(name, device, dtype)
    use_matmul_backend(model, backend)
    return backend
