"""The FFN kinds of a STEM layer, one file each, and their registry.

| kind | layer output |
|---|---|
| ``dense`` | ``W_d (SiLU(W_g x) ⊙ W_u x)`` |
| ``stem`` (eq. 4) | ``W_d (SiLU(W_g x) ⊙ U_l[t])`` |
| ``stem_dagger`` (eq. 5) | ``W_d (SiLU(W_g x) ⊙ (W_u x + U_l[t]))`` |
| ``stem_gate`` (ablation) | ``W_d (SiLU(U_l[t]) ⊙ W_u x)`` |
| ``hash_moe`` (baseline) | top-1 SwiGLU expert chosen by a fixed, balanced hash of ``t`` |
| ``ngram`` / ``ngram_dagger`` / ``engram`` | n-gram keyed rows ``m = Σ_k U_l[k]`` (``ngram.py``): STEM-, STEM†- or Engram-style |

Each kind is a class (``base.FFNKind``) that computes its layer and declares its own facts:
parameters and FLOPs, which dense projection its table replaces, how it converts and calibrates.
A new kind is a file here plus its line in ``KINDS``; nothing else names kinds.
"""

from __future__ import annotations

from .base import FFNKind
from .dense import DenseFFN
from .hash_moe import HashMoEFFN
from .ngram import NGRAM_KINDS, EngramFFN, NgramDaggerFFN, NgramFFN
from .stem import StemFFN
from .stem_dagger import StemDaggerFFN
from .stem_gate import StemGateFFN

KINDS: dict[str, type[FFNKind]] = {k.name: k for k in (DenseFFN, StemFFN, StemDaggerFFN, StemGateFFN, HashMoEFFN,
                                                       *NGRAM_KINDS)}
FFN_KINDS = tuple(KINDS)
TABLE_KINDS = tuple(name for name, kind in KINDS.items() if kind.owns_table)  # kinds that own a token-indexed table
DENSE = DenseFFN.name  # the kind a Llama layer is: for code that converts to it or compares against it


def ffn_kind(name: str) -> type[FFNKind]:
    """The class of FFN kind ``name`` (a one-line ``ValueError`` naming the kinds otherwise)."""
    try:
        return KINDS[name]
    except KeyError:
        raise ValueError(f"unknown ffn kind {name!r}; choose one of {', '.join(FFN_KINDS)}") from None


__all__ = ["DENSE", "FFN_KINDS", "KINDS", "TABLE_KINDS", "DenseFFN", "EngramFFN", "FFNKind", "HashMoEFFN",
           "NgramDaggerFFN", "NgramFFN", "StemDaggerFFN", "StemFFN", "StemGateFFN", "ffn_kind"]
