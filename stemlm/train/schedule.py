"""Learning-rate schedule: linear warmup, then cosine or linear decay to ``min_lr_ratio`` × peak.

A pure function of the step, so resuming needs no scheduler state.
"""

from __future__ import annotations

import math


def lr_factor(step: int, total_steps: int, warmup_ratio: float, decay: str = "cosine", min_ratio: float = 0.1) -> float:
    """Multiplier of the peak lr for the optimizer step ``step`` (0-based) of ``total_steps``.

    Warmup is ``(step + 1) / warmup_steps`` so the first step already learns; after warmup the
    factor falls from 1 to ``min_ratio`` at the last step.
    """
    warmup = int(round(warmup_ratio * total_steps))
    if step < warmup:
        return (step + 1) / warmup
    span = max(1, total_steps - 1 - warmup)
    progress = min(1.0, (step - warmup) / span)
    if decay == "cosine":
        shape = 0.5 * (1 + math.cos(math.pi * progress))
    elif decay == "linear":
        shape = 1 - progress
    else:
        raise ValueError(f"unknown decay {decay!r}; use cosine or linear")
    return min_ratio + (1 - min_ratio) * shape
