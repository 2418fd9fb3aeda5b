"""dense: Llama's SwiGLU, ``y = W_d (SiLU(W_g x) ⊙ W_u x)``."""

from __future__ import annotations

import torch.nn.functional as F

from .base import FFNKind, linear


class DenseFFN(FFNKind):
    """SwiGLU feed-forward of Llama."""

    name = "dense"

    def __init__(self, cfg):
        super().__init__()
        self.w_gate, self.w_up, self.w_down = linear(cfg.d_model, cfg.d_ff), linear(cfg.d_model, cfg.d_ff), \
            linear(cfg.d_ff, cfg.d_model)

    def forward(self, x, rows=None, ids=None):
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))
