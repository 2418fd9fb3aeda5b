"""The five feed-forward kinds. ``x`` is the normed hidden state, ``rows`` the table rows ``U_l[t]``.

* dense:        y = W_d (SiLU(W_g x) ⊙ W_u x)
* stem:         y = W_d (SiLU(W_g x) ⊙ U_l[t])              (paper eq. 4)
* stem_dagger:  y = W_d (SiLU(W_g x) ⊙ (W_u x + U_l[t]))    (paper eq. 5)
* stem_gate:    y = W_d (SiLU(U_l[t]) ⊙ W_u x)              (ablation: the table feeds the gate)
* hash_moe:     y = FFN_e(x), e = hash(t), top-1 of E dense SwiGLU experts (Roller et al. 2021)
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..config import ModelConfig


def _linear(d_in: int, d_out: int) -> nn.Linear:
    return nn.Linear(d_in, d_out, bias=False)


class DenseFFN(nn.Module):
    """SwiGLU feed-forward of Llama."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w_gate, self.w_up, self.w_down = _linear(cfg.d_model, cfg.d_ff), _linear(cfg.d_model, cfg.d_ff), _linear(cfg.d_ff, cfg.d_model)

    def forward(self, x, rows=None, ids=None):
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))


class StemFFN(nn.Module):
    """STEM: the up-projection is replaced by the token's table row."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w_gate, self.w_down = _linear(cfg.d_model, cfg.d_ff), _linear(cfg.d_ff, cfg.d_model)

    def forward(self, x, rows=None, ids=None):
        return self.w_down(F.silu(self.w_gate(x)) * rows)


class StemDaggerFFN(nn.Module):
    """STEM†: the table row is added to the up-projection.

    ``up_scale`` and ``row_scale`` (plain floats, 1 by default, not saved) weigh the two terms,
    ``up_scale · W_u x + row_scale · U_l[t]``; gradual insertion (``stemlm.insert.anneal``) moves
    them during training from the dense layer (1, 0 or zero rows) to pure STEM (0, 1).
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w_gate, self.w_up, self.w_down = _linear(cfg.d_model, cfg.d_ff), _linear(cfg.d_model, cfg.d_ff), _linear(cfg.d_ff, cfg.d_model)
        self.up_scale, self.row_scale = 1.0, 1.0

    def forward(self, x, rows=None, ids=None):
        if self.up_scale == 1.0 and self.row_scale == 1.0:
            return self.w_down(F.silu(self.w_gate(x)) * (self.w_up(x) + rows))
        return self.w_down(F.silu(self.w_gate(x)) * (self.up_scale * self.w_up(x) + self.row_scale * rows))


class StemGateFFN(nn.Module):
    """Ablation: the gate projection is replaced by the token's table row."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w_up, self.w_down = _linear(cfg.d_model, cfg.d_ff), _linear(cfg.d_ff, cfg.d_model)

    def forward(self, x, rows=None, ids=None):
        return self.w_down(F.silu(rows) * self.w_up(x))


def token_expert_hash(vocab_size: int, n_experts: int, seed: int) -> torch.Tensor:
    """Fixed, balanced token -> expert map: a seeded permutation of the vocabulary dealt
    round-robin, so expert sizes differ by at most one token id."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randperm(vocab_size, generator=gen) % n_experts


class HashMoEFFN(nn.Module):
    """Top-1 Hash-MoE baseline: each token id is routed to a fixed expert."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        e, d, f = cfg.n_experts, cfg.d_model, cfg.d_ff
        self.w_gate = nn.Parameter(torch.empty(e, f, d))
        self.w_up = nn.Parameter(torch.empty(e, f, d))
        self.w_down = nn.Parameter(torch.empty(e, d, f))
        self.register_buffer("expert_of_token", token_expert_hash(cfg.vocab_size, e, cfg.hash_seed), persistent=False)

    def forward(self, x, rows=None, ids=None):
        flat_x = x.reshape(-1, x.shape[-1])  # (N, d)
        experts = self.expert_of_token[ids.reshape(-1)]  # (N,)
        out = torch.zeros_like(flat_x)
        for e in torch.unique(experts).tolist():
            sel = (experts == e).nonzero(as_tuple=True)[0]
            h = flat_x[sel]
            y = F.linear(F.silu(F.linear(h, self.w_gate[e])) * F.linear(h, self.w_up[e]), self.w_down[e])
            out.index_copy_(0, sel, y)
        return out.view_as(x)


FFN_CLASSES = {"dense": DenseFFN, "stem": StemFFN, "stem_dagger": StemDaggerFFN, "stem_gate": StemGateFFN,
               "hash_moe": HashMoEFFN}
