"""How an entity of ``n`` tokens takes the rows of an entity of ``m`` tokens.

Notation: the *source* entity (the one being rewritten, e.g. " France") has tokens
``s_0 .. s_{n-1}``; the *target* entity (whose knowledge it receives, e.g. " United States")
has rows ``R_0 .. R_{m-1}`` in one table layer; ``F`` is the row of the *filler* token. Every
strategy returns ``n`` rows, the new rows of ``s_0 .. s_{n-1}``, computed per layer.

==============  ===========================================================================
strategy        row written to source token ``s_k``
==============  ===========================================================================
one_to_one      ``R_k``; requires ``n == m`` (the only exact swap).
filler          ``align="left"``:  ``R_k`` if ``k < m`` else ``F``  (target rows past ``n`` are
                dropped). ``align="right"``: positions are counted from the end: ``s_{n-1-j}``
                gets ``R_{m-1-j}`` if ``j < m`` else ``F``. With ``n > m`` this is padding the
                target with filler rows.
clone           ``align="left"``:  ``R_{min(k, m-1)}`` (surplus source tokens repeat the last
                target row). ``align="right"``: ``s_{n-1-j}`` gets ``R_{max(m-1-j, 0)}`` (surplus
                source tokens repeat the first target row).
average         ``mean(R_0 .. R_{m-1})`` for every ``k`` (computed in fp32).
auto            ``one_to_one`` when ``n == m``, else ``average``.
==============  ===========================================================================

The filler token is chosen by the caller (``edit(..., filler=...)``): by default the
tokenizer's end-of-text token, which every document of the training data starts with (see
``stemlm/data/tokens.py``), so its rows are trained and carry no entity.

Under a causal LM the last token of an entity is where the model reads the entity back out, so
``align="right"`` keeps the target's last row on the source's last token.
"""

from __future__ import annotations

import torch

STRATEGIES = ("auto", "one_to_one", "filler", "clone", "average")
ALIGNS = ("left", "right")


def check_strategy(strategy: str, align: str = "left") -> None:
    """Clear one-line errors for unknown names."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}")
    if align not in ALIGNS:
        raise ValueError(f"unknown align {align!r}; choose one of {', '.join(ALIGNS)}")


def resolve_strategy(strategy: str, n: int, m: int) -> str:
    """The concrete strategy for lengths ``n`` (source) and ``m`` (target)."""
    if strategy == "auto":
        return "one_to_one" if n == m else "average"
    if strategy == "one_to_one" and n != m:
        raise ValueError(f"strategy 'one_to_one' needs equal lengths, got {n} source vs {m} target tokens; "
                         "use filler, clone or average")
    return strategy


def source_index_map(strategy: str, n: int, m: int, align: str = "left") -> list[int | None]:
    """For each source position, the target position whose row it gets (``None`` = filler).

    ``average`` has no such map (every position gets the mean) and returns ``[]``.
    """
    strategy = resolve_strategy(strategy, n, m)
    if strategy == "average":
        return []
    if strategy == "one_to_one":
        return list(range(n))
    out: list[int | None] = []
    for k in range(n):
        j = k if align == "left" else n - 1 - k  # offset from the aligned end
        if strategy == "filler":
            idx = j if j < m else None
        else:  # clone
            idx = min(j, m - 1)
        out.append(idx if align == "left" or idx is None else m - 1 - idx)
    return out


def map_rows(target_rows: torch.Tensor, n: int, strategy: str = "auto", align: str = "left",
             filler_row: torch.Tensor | None = None) -> torch.Tensor:
    """New rows ``(n, d)`` for the source tokens from the target rows ``(m, d)`` of one layer."""
    check_strategy(strategy, align)
    m = target_rows.shape[0]
    if n < 1 or m < 1:
        raise ValueError(f"both entities need at least one token, got {n} source and {m} target tokens")
    concrete = resolve_strategy(strategy, n, m)
    if concrete == "average":
        mean = target_rows.float().mean(dim=0).to(target_rows.dtype)  # (d,)
        return mean.expand(n, -1).clone()
    index = source_index_map(concrete, n, m, align)
    if any(i is None for i in index) and filler_row is None:
        raise ValueError("strategy 'filler' needs a filler row (pass filler=<token> to the edit)")
    return torch.stack([filler_row if i is None else target_rows[i] for i in index])
