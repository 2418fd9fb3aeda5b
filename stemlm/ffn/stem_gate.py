"""stem_gate (ablation): the gate projection is replaced by the token's table row, ``y = W_d (SiLU(U_l[t]) ⊙ W_u x)``."""

from __future__ import annotations

import torch.nn.functional as F

from .base import FFNKind, linear


class StemGateFFN(FFNKind):
    """Ablation: the gate projection is replaced by the token's table row."""

    name = "stem_gate"
    owns_table = True
    table_from = replaces = "w_gate"

    def __init__(self, cfg):
        super().__init__()
        self.w_up, self.w_down = linear(cfg.d_model, cfg.d_ff), linear(cfg.d_ff, cfg.d_model)

    def forward(self, x, rows=None, ids=None):
        return self.w_down(self.hidden(self, x, rows))

    @classmethod
    def weights(cls, cfg) -> int:
        return 2 * cfg.d_model * cfg.d_ff

    @staticmethod
    def hidden(dense, x, rows):
        return F.silu(rows) * dense.w_up(x)

    @staticmethod
    def calibration_target(dense, x):
        """``W_g x`` (the gate's pre-activation) weighted by ``(W_u x)²``: STEM's fit with the roles exchanged."""
        gate, up = dense.w_gate(x), dense.w_up(x)  # (N, d_ff) each
        return gate, up.square()
