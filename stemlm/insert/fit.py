"""Per-layer statistics and the table rows fitted from them (calibrated insertion).

At a STEM layer the dense FFN computes ``y = W_d (g ⊙ a)`` with ``g = SiLU(W_g x)`` and
``a = W_u x``; STEM replaces ``a`` by the row ``u_t`` of the current token ``t``. Over the
calibration contexts where ``t`` occurs, the row that best replaces ``a`` is fitted here:

* ``gated`` — per coordinate, the least-squares fit of the gated product
  ``min_u Σ (g_i a_i − g_i u_i)²``: the mean of ``a_i`` weighted by ``g_i²``;
* ``mean`` — the plain mean of ``a`` (every context weighted alike);
* ``down`` — the least-squares fit through the down-projection,
  ``min_u Σ ||W_d (g ⊙ a) − W_d (g ⊙ u)||²``, solved per token by conjugate gradients started
  from ``gated`` (the normal matrix ``Σ diag(g) W_dᵀW_d diag(g)`` is never formed);
* ``zero`` — zero rows (for ``stem_dagger`` this is exactly the dense model).

Ids never seen in the calibration text get the ``unseen`` default: the fitted row of all
contexts pooled (``pooled``: ``gated``/``mean`` over every token), ``zero``, or ``regress``: a
ridge regression from the input embedding to the fitted rows of the seen ids (weighted by how
often each was seen), applied to the embeddings of the unseen ones.

``stem_gate`` (the table feeds the gate) is fitted the same way with the roles of ``W_g`` and
``W_u`` exchanged: the row replaces the gate's pre-activation ``W_g x``, weighted by ``a²``. Each
FFN kind gives its target and weight (``calibration_target``, ``stemlm.ffn``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

METHODS = ("gated", "mean", "down", "zero")
UNSEEN = ("pooled", "zero", "regress")


@dataclass
class LayerStats:
    """Sums over the calibration contexts of one layer, per token id (``V × d_ff`` each)."""

    weight: torch.Tensor  # Σ w            (V, d_ff): w = g² (gated) or 1 (mean)
    weighted: torch.Tensor  # Σ w · a      (V, d_ff)
    count: torch.Tensor  # occurrences    (V,)

    @classmethod
    def zeros(cls, vocab: int, dim: int, device: torch.device | str | None = None) -> "LayerStats":
        def z(*shape, dtype=torch.float64):
            return torch.zeros(*shape, dtype=dtype, device=device)
        return cls(z(vocab, dim), z(vocab, dim), z(vocab, dtype=torch.int64))

    def add(self, ids: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None) -> None:
        """Accumulate ``target (N, d_ff)`` (the activation a row replaces) at token ``ids (N,)``,
        each coordinate weighted by ``weight (N, d_ff)`` (None = 1)."""
        w = torch.ones_like(target) if weight is None else weight
        self.weight.index_add_(0, ids, w.double())
        self.weighted.index_add_(0, ids, (w * target).double())
        self.count.index_add_(0, ids, torch.ones_like(ids))

    def rows(self, unseen: str = "pooled", embedding: torch.Tensor | None = None, eps: float = 1e-12,
             shrink: float = 0.0) -> torch.Tensor:
        """The fitted table ``(V, d_ff)`` fp32: the weighted mean per id, ``unseen`` where no context
        was seen (``regress`` needs the input ``embedding (V, d)``).

        ``shrink > 0`` adds that many pseudo-contexts of the pooled fit to every seen id (each weighted
        like an average context), so the rows of ids seen a few times lean towards the pooled row."""
        if unseen not in UNSEEN:
            raise ValueError(f"unknown unseen-id default {unseen!r}; choose one of {', '.join(UNSEEN)}")
        seen = self.count > 0
        out = torch.zeros_like(self.weighted)
        prior_w = shrink * self.weight.sum(0) / self.count.sum().clamp_min(1)  # (d_ff,) shrink × mean weight
        pooled = self.weighted.sum(0) / self.weight.sum(0).clamp_min(eps)
        out[seen] = (self.weighted[seen] + prior_w * pooled) / (self.weight[seen] + prior_w).clamp_min(eps)
        if unseen == "pooled":
            out[~seen] = pooled
        elif unseen == "regress":
            if embedding is None:
                raise ValueError("unseen='regress' needs the input embedding")
            out[~seen] = regress_rows(embedding.double(), out, seen, self.count.double())[~seen]
        return out.float()


def regress_rows(embedding: torch.Tensor, rows: torch.Tensor, seen: torch.Tensor, weight: torch.Tensor,
                 ridge: float = 1e-2) -> torch.Tensor:
    """Rows predicted from the embedding: ``[e, 1] @ A`` with ``A`` the ridge fit of the ``seen``
    rows on their embeddings (each weighted by ``weight``, e.g. its count); ``(V, d_ff)``."""
    x = torch.cat([embedding, embedding.new_ones(len(embedding), 1)], 1)  # (V, d + 1)
    xs, ys, w = x[seen], rows[seen].to(x.dtype), weight[seen][:, None]
    gram = xs.T @ (w * xs)
    reg = ridge * gram.diagonal().mean() * torch.eye(gram.shape[0], dtype=gram.dtype, device=gram.device)
    coef = torch.linalg.solve(gram + reg, xs.T @ (w * ys))  # (d + 1, d_ff)
    return x @ coef


@torch.no_grad()
def refine_through_down(rows: torch.Tensor, ids: torch.Tensor, gate: torch.Tensor, target_out: torch.Tensor,
                        w_down: torch.Tensor, iters: int = 8, chunk: int = 8192) -> torch.Tensor:
    """Rows fitted through the down-projection: ``min_u Σ_n ||y_n − W_d (g_n ⊙ u_{t_n})||²``.

    ``rows (V, d_ff)`` is the start, ``ids (N,)`` the tokens of the contexts, ``gate (N, d_ff)``
    their ``g``, ``target_out (N, d)`` the output to match. Conjugate gradients on every token's
    own normal equations at once (step sizes per token); rows of ids absent from ``ids`` are kept.
    The contexts are visited ``chunk`` at a time (products in fp32, sums in fp64), so the temporaries stay
    ``chunk × d_ff``.
    """
    V = rows.shape[0]
    uniq, inv = torch.unique(ids, return_inverse=True)
    u = rows[uniq].double()  # (U, d_ff)
    wd = w_down.float()
    parts = [slice(a, min(len(inv), a + chunk)) for a in range(0, len(inv), chunk)]  # bounded temporaries

    def normal(p: torch.Tensor) -> torch.Tensor:  # A p = Σ_n g ⊙ W_dᵀ W_d (g ⊙ p_{t_n}); fp32 products, fp64 sums
        out = torch.zeros_like(p)
        pf = p.float()
        for c in parts:
            g = gate[c].float()
            out.index_add_(0, inv[c], ((g * pf[inv[c]]) @ wd.T @ wd * g).double())  # (n, d_ff)
        return out

    rhs = torch.zeros_like(u)
    for c in parts:  # Σ g ⊙ W_dᵀ y
        rhs.index_add_(0, inv[c], ((target_out[c].float() @ wd) * gate[c].float()).double())
    r = rhs - normal(u)
    p, rs = r.clone(), (r * r).sum(1)
    for _ in range(iters):
        ap = normal(p)
        alpha = rs / (p * ap).sum(1).clamp_min(1e-30)  # (U,)
        u += alpha[:, None] * p
        r -= alpha[:, None] * ap
        rs_new = (r * r).sum(1)
        p = r + (rs_new / rs.clamp_min(1e-30))[:, None] * p
        rs = rs_new
    out = rows.clone()
    out[uniq] = u.float()
    assert out.shape[0] == V
    return out


class DownRefit:
    """Least-squares refit of ``W_d`` given the STEM hidden activations: ``min_W Σ ||y − W h||²``
    with ``h = g ⊙ u_t`` (``(d, d_ff)``; ``ridge`` scales a Tikhonov term by the mean diagonal)."""

    def __init__(self, d_ff: int, d: int, device: torch.device | str | None = None):
        self.hh = torch.zeros(d_ff, d_ff, dtype=torch.float64, device=device)
        self.yh = torch.zeros(d, d_ff, dtype=torch.float64, device=device)

    def add(self, hidden: torch.Tensor, target_out: torch.Tensor) -> None:
        h, y = hidden.double(), target_out.double()
        self.hh += h.T @ h
        self.yh += y.T @ h

    def solve(self, ridge: float = 1e-3) -> torch.Tensor:
        reg = ridge * self.hh.diagonal().mean().clamp_min(1e-30)
        a = self.hh + reg * torch.eye(self.hh.shape[0], dtype=self.hh.dtype, device=self.hh.device)
        return torch.linalg.solve(a, self.yh.T).T.float()  # (d, d_ff)
