"""stem_dagger (STEM†, paper eq. 5): the table row is added to the up-projection,
``y = W_d (SiLU(W_g x) ⊙ (W_u x + U_l[t]))``."""

from __future__ import annotations

import torch.nn.functional as F

from .base import FFNKind
from .stem import StemFFN


class StemDaggerFFN(FFNKind):
    """STEM†: the table row is added to the up-projection.

    ``up_scale`` and ``row_scale`` (plain floats, 1 by default, not saved) weigh the two terms,
    ``up_scale · W_u x + row_scale · U_l[t]``; gradual insertion (``stemlm.insert.anneal``) moves
    them during training from the dense layer (1, 0 or zero rows) to pure STEM (0, 1).
    """

    name = "stem_dagger"
    owns_table = True
    table_from = "w_up"
    zero_rows_are_dense = True
    anneals_to = StemFFN.name  # up_scale 0, row_scale 1: pure STEM

    def __init__(self, cfg):
        super().__init__(cfg)
        self.up_scale, self.row_scale = 1.0, 1.0

    def forward(self, x, rows=None, ids=None):
        if self.up_scale == 1.0 and self.row_scale == 1.0:
            return self.w_down(self.hidden(self, x, rows))
        return self.w_down(F.silu(self.w_gate(x)) * (self.up_scale * self.w_up(x) + self.row_scale * rows))

    @staticmethod
    def hidden(dense, x, rows):
        return F.silu(dense.w_gate(x)) * (dense.w_up(x) + rows)

    calibration_target = staticmethod(StemFFN.calibration_target)  # rows fitted to stand for W_u x, as STEM's
