"""hash_moe (baseline, Roller et al. 2021): ``y = FFN_e(x)``, ``e = hash(t)``, the top-1 of ``E`` dense SwiGLU
experts chosen by a fixed, balanced hash of the token id."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..fields import ConfigError
from .base import FFNKind


def token_expert_hash(vocab_size: int, n_experts: int, seed: int) -> torch.Tensor:
    """Fixed, balanced token -> expert map: a seeded permutation of the vocabulary dealt
    round-robin, so expert sizes differ by at most one token id."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randperm(vocab_size, generator=gen) % n_experts


def matched_expert_count(d_model: int, vocab_size: int) -> int:
    """Experts per Hash-MoE layer whose parameters match one STEM layer.

    A STEM layer holds W_g, W_d (2·d·d_ff) plus its table (V·d_ff); an expert holds 3·d·d_ff,
    so E = round((2d + V) / 3d), independent of d_ff.
    """
    return max(1, round((2 * d_model + vocab_size) / (3 * d_model)))


def expected_experts_touched(n_experts: int, n_tokens: float) -> float:
    """Distinct experts hit by ``n_tokens`` tokens under a balanced hash (uniform over experts)."""
    return n_experts * (1 - (1 - 1 / n_experts) ** n_tokens)


class HashMoEFFN(FFNKind):
    """Top-1 Hash-MoE baseline: each token id is routed to a fixed expert."""

    name = "hash_moe"
    from_dense = False  # its experts have no Llama counterpart
    routes_by_data = True

    def __init__(self, cfg):
        nn.Module.__init__(self)  # experts, not Linears: built here
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

    def init_weights_(self, cfg, init) -> None:
        for w in (self.w_gate, self.w_up, self.w_down):
            init.normal_(w, std=cfg.init_std)
        # a non-persistent buffer: rebuilt here because from_pretrained leaves it uninitialised
        init.copy_(self.expert_of_token, token_expert_hash(cfg.vocab_size, cfg.n_experts, cfg.hash_seed))

    @classmethod
    def weights(cls, cfg) -> int:
        if cfg.n_experts is None:
            raise ValueError("a hash_moe layer needs n_experts (set ffn='hash_moe' so it is derived)")
        return cfg.n_experts * len(cls.holds) * cfg.d_model * cfg.d_ff

    @classmethod
    def active_weights(cls, cfg) -> int:
        return len(cls.holds) * cfg.d_model * cfg.d_ff  # one expert per token

    @classmethod
    def weights_read(cls, cfg, n_tokens: float) -> float:
        """The experts the step's tokens touch (a balanced hash spreads them uniformly)."""
        return cls.weights(cfg) - cls.active_weights(cfg) * (cfg.n_experts - expected_experts_touched(cfg.n_experts, n_tokens))

    @classmethod
    def derived_fields(cls, cfg) -> dict:
        n = matched_expert_count(cfg.d_model, cfg.vocab_size) if cfg.n_experts is None else cfg.n_experts
        if n < 1:
            raise ConfigError(f"n_experts must be >= 1, got {n}")
        return {"n_experts": n}
