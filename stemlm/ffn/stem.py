"""stem (paper eq. 4): the up-projection is replaced by the token's table row, ``y = W_d (SiLU(W_g x) ⊙ U_l[t])``."""

from __future__ import annotations

import torch.nn.functional as F

from .base import FFNKind
from .rows import IndexedRows


class StemFFN(FFNKind):
    """STEM: the up-projection is replaced by the token's table row."""

    name = "stem"
    holds = ("w_gate", "w_down")  # the row replaces W_u: d·d_ff parameters and MACs saved
    owns_table = True
    table_from = "w_up"
    fuses_row_gather = True

    def forward(self, x, rows=None, ids=None):
        if isinstance(rows, IndexedRows) and rows.fuses_gemms:  # the table work inside the GEMMs' epilogues
            return rows.gated_ffn(x, self.w_gate.weight, self.w_down.weight)
        return super().forward(x, rows, ids)

    @staticmethod
    def hidden(dense, x, rows):
        if isinstance(rows, IndexedRows):  # the fused table kernels: the row is gathered inside the product
            return rows.gated(dense.w_gate(x))
        return F.silu(dense.w_gate(x)) * rows

    @staticmethod
    def calibration_target(dense, x):
        """``W_u x`` weighted by ``SiLU(W_g x)²`` (the least-squares fit of the gated product)."""
        gate, up = dense.w_gate(x), dense.w_up(x)  # (N, d_ff) each
        return up, F.silu(gate).square()

    @staticmethod
    def gate_of_rows(dense, x):
        return F.silu(dense.w_gate(x))
