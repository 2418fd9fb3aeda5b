"""Equal tuning: every variant's best peak lr from the sweep, the same rule for all.

The sweep trains each variant at each lr of its tuning grid (``sweep.lrs``) with the same seeds,
steps and optimizer setting. A variant's best lr is the one with the lowest mean final validation
loss over the sweep seeds (a diverged run counts as infinitely bad); ties go to the smaller lr. A
best lr at either end of the grid is flagged — the optimum may lie outside it — unless a run at an lr
beyond that end (the stability stage's extra lrs) did worse, which brackets the optimum.

With ``sweep.resolve`` (``resolve``) the sweep resolves its pick before the comparison starts. The
candidates are every lr a variant was trained at with the sweep seeds (the grid and the stability
stage's stress lrs alike); while the best sits at an end of them, the next lr past that end (× or ÷
``factor``, by default the grid's top ratio) is trained, up to ``extend`` times; then every candidate
within ``within`` nats of the best (sweep seeds' mean) is trained at the extra ``seeds`` too, and the
best of those by the mean over all seeds is the variant's lr.

With ``resolve.confirm_steps`` the pick is made at the comparison's length instead: a sweep of a
sixth of an epoch favours large lrs (they lead early and fall behind later: STEM-1/3's stress lr
1e-2 led the 192-step sweep by 0.04 nats and ended 0.33 nats behind 2e-3 over the full epoch), so
the candidates near the best, and the best lr of the tuning grid (or its extensions) when no grid lr
is near, are each trained for ``confirm_steps`` at the sweep seeds (role ``confirm``; their runs
carry ``-steps{N}`` in their names and are kept out of the sweep's table), and the lowest final
loss there is the variant's lr. The extra ``seeds`` are not used then. A variant with one candidate
that is a grid lr needs no confirmation.
"""

from __future__ import annotations

import math
from collections import defaultdict


def is_confirm(r: dict) -> bool:
    """Whether a sweep result is a confirmation at the comparison's length (``resolve.confirm_steps``)."""
    return "confirm" in r["labels"].get("roles", [])


def sweep_table(runs: list[dict]) -> dict[str, dict[float, dict]]:
    """``{variant: {lr: {"loss", "losses", "diverged", "roles", "names"}}}`` of the sweep's result JSON
    (its own length: confirmation runs are left out)."""
    out: dict[str, dict[float, dict]] = defaultdict(dict)
    for r in runs:
        if r["stage"] != "sweep" or is_confirm(r):
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


RESOLVE_DEFAULTS = {"seeds": [1, 2], "within": 0.05, "extend": 2, "factor": None, "confirm_steps": None}


def _per_seed(runs: list[dict], confirm: bool = False) -> dict[str, dict[float, dict[int, float]]]:
    """``{variant: {lr: {seed: final loss}}}`` of finished or diverged sweep results (diverged: inf): the
    sweep's own runs, or with ``confirm`` its confirmations at the comparison's length."""
    out: dict = defaultdict(lambda: defaultdict(dict))
    for r in runs:
        if r["stage"] == "sweep" and is_confirm(r) == confirm:
            loss = r["metrics"]["final_val_loss"]
            out[r["labels"]["variant"]][float(r["labels"]["lr"])][r["labels"].get("seed", 0)] = (
                math.inf if r["status"] == "diverged" or loss is None else loss)
    return out


def _mean(losses: dict[int, float], seeds: list[int]) -> float:
    return sum(losses[s] for s in seeds) / len(seeds)


def resolve(runs: list[dict], sweep: dict) -> dict[str, dict]:
    """Per sweep variant: ``{"resolved", "extra", "lr", "loss", "edge", "grid", "near", "seeds"}``.

    The candidates are every lr the variant has sweep-seed results at (the grid, the stability stage's
    stress lrs, earlier extensions). ``extra``: ``[(lr, seed, role)]`` beyond those that the resolution
    asks for (role ``extend`` or ``resolve``); ``resolved``: every run it needs has finished, and ``lr``
    is the pick."""
    cfg = {**RESOLVE_DEFAULTS, **(sweep.get("resolve") or {})}
    grid = sorted(float(x) for x in sweep["lrs"])
    base = list(sweep.get("seeds") or [0])
    more = [s for s in cfg["seeds"] if s not in base]
    factor = float(cfg["factor"] or (grid[-1] / grid[-2] if len(grid) > 1 else 2.0))
    table, confirmed, extended, out = _per_seed(runs), _per_seed(runs, confirm=True), _extended(runs), {}
    for variant in sweep["variants"]:
        cells = table.get(variant, {})
        have = lambda lr, seeds: all(s in cells.get(lr, {}) for s in seeds)  # noqa: E731
        extra = [(lr, s, "extend") for lr in sorted(extended.get(variant, ())) for s in base]
        state = {"resolved": False, "extra": extra, "lr": None, "loss": None, "edge": None, "grid": grid}
        out[variant] = state
        if not all(have(lr, base) for lr in grid):
            continue
        tried = sorted(set(grid) | {lr for lr in cells if have(lr, base)})
        for _ in range(int(cfg["extend"]) - len(extended.get(variant, ()))):
            best = min(tried, key=lambda lr: (_mean(cells[lr], base), lr))
            edge = "high" if best == max(tried) else "low" if best == min(tried) else None
            if edge is None:
                break
            new = best * factor if edge == "high" else best / factor
            tried.append(new)
            extra += [(new, s, "extend") for s in base]
            if not have(new, base):
                break
        if not all(have(lr, base) for lr in tried):
            continue
        best0 = min(_mean(cells[lr], base) for lr in tried)
        near = sorted(lr for lr in tried if _mean(cells[lr], base) - best0 <= float(cfg["within"]))
        if cfg["confirm_steps"]:
            _confirm(state, variant, cells, confirmed.get(variant, {}), tried, near, base, grid,
                     extended.get(variant, set()))
            continue
        extra += [(lr, s, "resolve") for lr in near for s in more]
        if not all(have(lr, base + more) for lr in near):
            continue
        choice = min(near, key=lambda lr: (_mean(cells[lr], base + more), lr))
        _settle(state, choice, cells, base + more, tried, near)
    return out


def _confirm(state: dict, variant: str, cells: dict, confirmed: dict, tried: list[float], near: list[float],
             base: list[int], grid: list[float], extended: set[float]) -> None:
    """``resolve.confirm_steps``: the pick among the candidates by their losses at the comparison's length."""
    tuning = set(grid) | extended  # the grid and its extensions; stress lrs are candidates only when near
    candidates = set(near)
    if not candidates & tuning:
        candidates.add(min((lr for lr in tried if lr in tuning), key=lambda lr: (_mean(cells[lr], base), lr)))
    candidates = sorted(candidates)
    if len(candidates) > 1 or candidates[0] not in tuning:
        state["extra"] += [(lr, s, "confirm") for lr in candidates for s in base]
        if not all(s in confirmed.get(lr, {}) for lr in candidates for s in base):
            return
        choice = min(candidates, key=lambda lr: (_mean(confirmed[lr], base), lr))
        state.update(confirmed={lr: _mean(confirmed[lr], base) for lr in candidates})
    else:
        choice = candidates[0]
    _settle(state, choice, cells, base, tried, candidates)


def _settle(state: dict, choice: float, cells: dict, seeds: list[int], tried: list[float], near: list[float]) -> None:
    """Record ``choice`` as the variant's lr: its loss over ``seeds``, and the grid edge it sits at (if any)."""
    edge = "high" if choice == max(tried) else "low" if choice == min(tried) else None
    state.update(resolved=True, lr=choice, loss=_mean(cells[choice], seeds), edge=edge, grid=sorted(tried),
                 near=near, seeds=len(seeds))


def _extended(runs: list[dict]) -> dict[str, set[float]]:
    """``{variant: lrs}`` of the sweep runs an earlier resolution added past an edge (role ``extend``)."""
    out: dict = defaultdict(set)
    for r in runs:
        if r["stage"] == "sweep" and "extend" in r["labels"].get("roles", []):
            out[r["labels"]["variant"]].add(float(r["labels"]["lr"]))
    return out


def pick(runs: list[dict], sweep: dict) -> tuple[dict[str, dict], dict[str, list]]:
    """``(tuned, extra)``: each variant's pick (``best_lrs``, or ``resolve`` when the sweep asks for it) and the
    extra sweep runs ``{variant: [(lr, seed, role)]}`` the resolution needs. A variant is picked only once every
    run of its grid (and of its resolution) has finished."""
    if sweep.get("resolve"):
        res = resolve(runs, sweep)
        return ({v: r for v, r in res.items() if r["resolved"]}, {v: r["extra"] for v, r in res.items() if r["extra"]})
    grid = [float(x) for x in sweep.get("lrs") or []]
    seeds = set(sweep.get("seeds") or [0])
    done = defaultdict(set)
    for r in runs:
        if r["stage"] == "sweep" and float(r["labels"]["lr"]) in grid:
            done[r["labels"]["variant"]].add((float(r["labels"]["lr"]), r["labels"].get("seed", 0)))
    complete = {v for v, cells in done.items() if all((lr, s) in cells for lr in grid for s in seeds)}
    finished = [r for r in runs if r["stage"] == "sweep" and r["labels"]["variant"] in complete]
    return (best_lrs(finished, grid) if finished else {}), {}
