"""stem (paper eq. 4): the up-projection is replaced by the token's table row, ``y = W_d (SiLU(W_g x) ⊙ U_l[t])``."""

from __future__ import annotations

import torch.nn.functional as F

from .base import FFNKind, linear


class StemFFN(FFNKind):
    """STEM: the up-projection is replaced by the token's table row."""

    name = "stem"
    owns_table = True
    table_from = replaces = "w_up"

    def __init__(self, cfg):
        super().__init__()
        self.w_gate, self.w_down = linear(cfg.d_model, cfg.d_ff), linear(cfg.d_ff, cfg.d_model)

    def forward(self, x, rows=None, ids=None):
        return self.w_down(self.hidden(self, x, rows))

    @classmethod
    def weights(cls, cfg) -> int:
        return 2 * cfg.d_model * cfg.d_ff  # the row replaces W_u: d·d_ff parameters and MACs saved

    @staticmethod
    def hidden(dense, x, rows):
        return F.silu(dense.w_gate(x)) * rows

    @staticmethod
    def calibration_target(dense, x):
        """``W_u x`` weighted by ``SiLU(W_g x)²`` (the least-squares fit of the gated product)."""
        gate, up = dense.w_gate(x), dense.w_up(x)  # (N, d_ff) each
        return up, F.silu(gate).square()

    @staticmethod
    def gate_of_rows(dense, x):
        return F.silu(dense.w_gate(x))
