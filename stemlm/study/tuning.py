"""Equal tuning: every variant's best peak lr from the sweep, the same rule for all.

The sweep trains each variant at each lr of its tuning grid (``sweep.lrs``) with the same seeds,
steps and optimizer setting. A variant's best lr is the one with the lowest mean final validation
loss over the sweep seeds (a diverged run counts as infinitely bad); ties go to the smaller lr. A
best lr at either end of the grid is flagged — the optimum may lie outside it — unless a run at an lr
beyond that end (the stability stage's extra lrs) did worse, which brackets the optimum.
"""

from __future__ import annotations

import math
from collections import defaultdict


def sweep_table(runs: list[dict]) -> dict[str, dict[float, dict]]:
    """``{variant: {lr: {"loss", "losses", "diverged", "roles", "names"}}}`` of the sweep's result JSON."""
    out: dict[str, dict[float, dict]] = defaultdict(dict)
    for r in runs:
        if r["stage"] != "sweep":
            continue
        lab = r["labels"]
        cell = out[lab["variant"]].setdefault(float(lab["lr"]), {"losses": [], "diverged": 0, "roles": lab.get("roles", []),
                                                                  "names": []})
        loss = r["metrics"]["final_val_loss"]
        cell["losses"].append(math.inf if r["status"] == "diverged" or loss is None else loss)
        cell["diverged"] += r["status"] == "diverged"
        cell["names"].append(r["name"])
    for cells in out.values():
        for cell in cells.values():
            cell["loss"] = sum(cell["losses"]) / len(cell["losses"])
    return dict(out)


def best_lrs(runs: list[dict], grid: list[float] | None = None) -> dict[str, dict]:
    """``{variant: {"lr", "loss", "edge"}}``: the best lr of each variant over the tuning grid (``grid``;
    default: the lrs whose runs carry the ``tune`` role); ``edge`` is ``"low"``/``"high"`` when it is
    the grid's smallest/largest lr."""
    out = {}
    for variant, cells in sweep_table(runs).items():
        tune = {lr: c for lr, c in cells.items() if (lr in grid if grid else "tune" in c["roles"])}
        if not tune or all(math.isinf(c["loss"]) for c in tune.values()):
            continue
        lrs = sorted(tune)
        best = min(lrs, key=lambda lr: (tune[lr]["loss"], lr))
        edge = "low" if best == lrs[0] and len(lrs) > 1 else "high" if best == lrs[-1] and len(lrs) > 1 else None
        beyond = [c["loss"] for lr, c in cells.items() if lr not in tune and (lr < best if edge == "low" else lr > best)]
        if edge and any(loss > tune[best]["loss"] for loss in beyond):
            edge = None  # a worse run beyond the grid's end brackets the optimum
        out[variant] = {"lr": best, "loss": tune[best]["loss"], "edge": edge, "grid": lrs}
    return out


def tuned_lrs(runs: list[dict], grid: list[float] | None = None) -> dict[str, float]:
    """``{variant: best lr}`` (what ``spec.plan`` takes)."""
    return {v: b["lr"] for v, b in best_lrs(runs, grid).items()}
