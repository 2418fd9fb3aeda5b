"""stem_gate (ablation): the gate projection is replaced by the token's table row, ``y = W_d (SiLU(U_l[t]) ⊙ W_u x)``."""

from __future__ import annotations

import torch.nn.functional as F

from .base import FFNKind


class StemGateFFN(FFNKind):
    """Ablation: the gate projection is replaced by the token's table row."""

    name = "stem_gate"
    holds = ("w_up", "w_down")  # the row replaces W_g
    owns_table = True
    table_from = "w_gate"

    @staticmethod
    def hidden(dense, x, rows):
        return F.silu(rows) * dense.w_up(x)

    @staticmethod
    def calibration_target(dense, x):
        """``W_g x`` (the gate's pre-activation) weighted by ``(W_u x)²``: STEM's fit with the roles exchanged."""
        gate, up = dense.w_gate(x), dense.w_up(x)  # (N, d_ff) each
        return gate, up.square()
