"""dense: Llama's SwiGLU, ``y = W_d (SiLU(W_g x) ⊙ W_u x)``."""

from __future__ import annotations

import torch.nn.functional as F

from .base import FFNKind


class DenseFFN(FFNKind):
    """SwiGLU feed-forward of Llama."""

    name = "dense"
    is_dense = True

    def forward(self, x, rows=None, ids=None):
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))
