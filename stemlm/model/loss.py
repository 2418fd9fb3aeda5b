"""Next-token cross-entropy fused with the LM head, computed in chunks of tokens.

``F.cross_entropy(h @ W.T, y)`` materialises the ``(N, V)`` logits, their log-softmax and, in
backward, the gradient of both: at N = 4096 tokens and V = 8192 that is three 134 MB tensors per
step, and the head's matmuls run on operands that no longer fit in cache. Here the tokens are
processed ``chunk`` at a time: each chunk's logits are formed, reduced to the loss, turned into
``softmax - onehot`` in place, and multiplied straight into the gradients of the hidden states and
the head weight (already divided by the token count). Backward only scales those by the incoming
gradient, and for the usual ``loss.backward()`` (gradient 1) hands them over untouched. Same FLOPs as the plain
path (three matmuls), a fraction of the memory traffic, and peak memory ``chunk × V`` instead of
``N × V``; the result equals ``F.cross_entropy`` up to float summation order.
"""

from __future__ import annotations

import torch

from ..runtime.matmul import mm_nn, mm_nt, onednn_applies

IGNORE_INDEX = -100
CHUNK_ELEMENTS = 1 << 22  # logits per chunk (16 MB in fp32): chunk = CHUNK_ELEMENTS // V tokens


def _chunked_loss(hidden, weight, targets, chunk: int, backend: str, need_grad: bool):
    """``(mean loss, grad_hidden, grad_weight)``; the gradients are None unless ``need_grad``."""
    denom = (targets != IGNORE_INDEX).sum().clamp(min=1).to(torch.float32)  # tokens in the mean
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    grad_hidden = torch.empty_like(hidden) if need_grad else None
    # oneDNN is faster at (d, c) @ (c, V) than at (V, c) @ (c, d): accumulate the head gradient transposed
    transposed = backend == "onednn" and onednn_applies(hidden, weight)
    grad_weight = weight.new_zeros(weight.shape[::-1] if transposed else weight.shape) if need_grad else None
    low_precision = torch.is_autocast_enabled(hidden.device.type)
    for start in range(0, hidden.shape[0], chunk):
        h = hidden[start:start + chunk]  # (c, d)
        t = targets[start:start + chunk]  # (c,)
        valid = t != IGNORE_INDEX
        safe_t = torch.where(valid, t, 0)[:, None]  # (c, 1)
        logits = mm_nt(h, weight, backend).float()  # (c, V)
        target_logit = logits.gather(1, safe_t).squeeze(1)  # (c,)
        row_max = logits.amax(dim=-1, keepdim=True)  # (c, 1)
        probs = logits.sub_(row_max).exp_()  # unnormalised softmax, in place of the logits
        row_sum = probs.sum(dim=-1, keepdim=True)  # (c, 1)
        lse = (row_max + row_sum.log()).squeeze(1)  # (c,) log-sum-exp, one exp pass in all
        total += torch.where(valid, lse - target_logit, 0.0).sum()
        if need_grad:
            # (softmax - onehot) / denom: the gradient of the mean; ignored tokens get 0
            weight_of_row = valid[:, None] / (row_sum * denom)  # (c, 1)
            probs.mul_(weight_of_row).scatter_add_(1, safe_t, -(valid[:, None] / denom).to(probs.dtype))
            probs = probs.to(hidden.dtype)
            grad_hidden[start:start + chunk] = mm_nn(probs, weight, backend)
            if transposed:
                grad_weight += mm_nn(h.t().to(weight.dtype), probs, backend)  # (d, c) @ (c, V)
            elif low_precision:  # the product in the autocast dtype (an in-place addmm_ is never autocast:
                grad_weight += probs.t() @ h  # it ran fp32 SIMT on the GPU), summed into the fp32 gradient
            else:
                grad_weight.addmm_(probs.t(), h.to(weight.dtype))  # (V, c) @ (c, d)
    if need_grad and transposed:
        grad_weight = grad_weight.t().contiguous()  # (V, d)
    return total / denom, grad_hidden, grad_weight


class _LinearCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of ``hidden (N, d) @ weight (V, d).T`` against ``targets (N,)``."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk: int, backend: str):
        need_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        loss, grad_hidden, grad_weight = _chunked_loss(hidden, weight, targets, chunk, backend, need_grad)
        ctx.save_for_backward(grad_hidden, grad_weight)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        grad_hidden, grad_weight = ctx.saved_tensors
        if grad_loss.device.type == "cpu" and grad_loss.item() == 1.0:  # loss.backward(): no pass over the grads
            return grad_hidden, grad_weight, None, None, None
        return grad_hidden * grad_loss.to(grad_hidden.dtype), grad_weight * grad_loss.to(grad_weight.dtype), None, None, None


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         chunk: int | None = None, backend: str = "aten") -> torch.Tensor:
    """Mean next-token cross-entropy (nats) of the logits ``hidden @ weight.T`` without forming them.

    ``hidden (..., d)``, ``weight (V, d)`` (the LM head), ``targets (...)`` with ``-100`` = ignore.
    ``chunk`` tokens are processed at a time (default: ``CHUNK_ELEMENTS // V``). Under autocast the
    head matmuls run in the autocast dtype; the softmax and the loss are always fp32. ``backend``
    (``aten`` | ``onednn``, see ``stemlm.runtime.matmul``) computes the logits and the hidden-state gradient.
    """
    hidden = hidden.reshape(-1, hidden.shape[-1])  # (N, d)
    targets = targets.reshape(-1)  # (N,)
    if hidden.shape[0] != targets.shape[0]:
        raise ValueError(f"{hidden.shape[0]} hidden states but {targets.shape[0]} targets")
    if chunk is None:
        chunk = max(1, CHUNK_ELEMENTS // weight.shape[0])
    if not torch.is_grad_enabled() or not (hidden.requires_grad or weight.requires_grad):
        # evaluation: no autograd node, and none of the gradient GEMMs (needs_input_grad stays
        # True under torch.no_grad, so the Function alone would still form them)
        return _chunked_loss(hidden, weight, targets, chunk, backend, need_grad=False)[0]
    return _LinearCrossEntropy.apply(hidden, weight, targets, chunk, backend)
