"""Training dynamics: a variant's validation-loss gap to dense against training tokens, and its trend.

For each seed, ``gap(t) = L_variant(t) − L_dense(t)`` at every evaluation both runs made (same seed:
same init seed and data order). The trend is a least-squares line of the gap on ``log2(tokens)``
over the evaluations in the last ``fraction`` of training (default: the second half), fitted per
seed; its slope (nats per doubling of the tokens) is averaged over seeds with a t interval. With
a negative gap and a positive slope the advantage is shrinking: the mean line says where it would
cross zero, ``t_end · 2^(−gap_end / slope)``, an extrapolation that assumes the trend goes on.
"""

from __future__ import annotations

import math
from collections import defaultdict

from .stats import fit_line, one_sample


def val_curves(runs: list[dict], stage: str = "compare") -> dict[str, dict[str, dict[int, list[dict]]]]:
    """``{size: {variant: {seed: [val points]}}}`` of a stage's finished runs."""
    out: dict = defaultdict(lambda: defaultdict(dict))
    for r in runs:
        if r["stage"] == stage and r["status"] == "finished":
            lab = r["labels"]
            out[lab["size"]][lab["variant"]][lab["seed"]] = r["metrics"]["val"]
    return out


def gap_curves(curves: dict[str, dict[int, list[dict]]], variant: str, base: str = "dense") -> dict[int, list[tuple]]:
    """``{seed: [(tokens, gap)]}`` over the evaluations both runs of the seed made."""
    out = {}
    for seed, points in curves.get(variant, {}).items():
        ref = {p["tokens"]: p["val_loss"] for p in curves.get(base, {}).get(seed, [])}
        pairs = [(p["tokens"], p["val_loss"] - ref[p["tokens"]]) for p in points if p["tokens"] in ref]
        if pairs:
            out[seed] = pairs
    return out


def gap_trend(gaps: dict[int, list[tuple]], fraction: float = 0.5, epoch_tokens: float | None = None) -> dict | None:
    """Slope of the gap per doubling of tokens over the last ``fraction`` of training (per seed, then
    averaged), the gap at the first and last shared evaluation, and the extrapolated crossing."""
    slopes, late = {}, {}
    for seed, pairs in gaps.items():
        t_end = pairs[-1][0]
        tail = [(t, g) for t, g in pairs if t >= (1 - fraction) * t_end and t > 0]
        if len(tail) >= 3:
            slopes[seed] = fit_line([math.log2(t) for t, _ in tail], [g for _, g in tail]).slope
            late[seed] = tail
    if not slopes:
        return None
    n_points = min(len(p) for p in gaps.values())
    mean_curve = [(gaps[next(iter(gaps))][i][0], sum(p[i][1] for p in gaps.values()) / len(gaps)) for i in range(n_points)]
    tail = [(t, g) for t, g in mean_curve if t >= (1 - fraction) * mean_curve[-1][0] and t > 0]
    line = fit_line([math.log2(t) for t, _ in tail], [g for _, g in tail]) if len(tail) >= 2 else None
    t_end, g_end = mean_curve[-1]
    cross = None
    if line is not None and line.slope != 0 and (g_end < 0) == (line.slope > 0):
        cross = t_end * 2 ** (-line.at(math.log2(t_end)) / line.slope)
    return {"slope": one_sample(list(slopes.values()), "paired").to_dict(), "slopes": slopes,
            "gap_first": mean_curve[0][1], "tokens_first": mean_curve[0][0], "gap_end": g_end, "tokens_end": t_end,
            "cross_tokens": cross, "cross_epochs": cross / epoch_tokens if cross and epoch_tokens else None,
            "fraction": fraction, "mean_curve": mean_curve}
