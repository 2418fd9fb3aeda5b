"""Aggregations of a study's result JSON (runs and evals) into rows for the report and plots.

Everything here reads the JSON written by ``runner`` and ``evalstage`` only. Seeds are combined
as mean ± half-range (half of max - min over seeds).
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

from .. import accounting as acc
from .measures import loss_roi
from .probes import probe_of
from .timing import wall_from_timing
from .variants import BASELINE


def load_results(results_dir: str | Path) -> tuple[list[dict], dict[tuple[str, str], dict]]:
    """``(runs, evals)``: every run result, and eval results keyed ``(run name, point)``."""
    root = Path(results_dir)
    if not (root / "runs").is_dir():
        raise FileNotFoundError(f"{root} holds no study results (no runs/ directory); run `stemlm study run` first")
    runs = [json.loads(p.read_text()) for p in sorted((root / "runs").glob("*.json"))]
    evals = {}
    for p in sorted((root / "eval").glob("*.json")) if (root / "eval").is_dir() else []:
        e = json.loads(p.read_text())
        evals[(e["run"], e["point"])] = e
    return runs, evals


def mean_spread(values: list[float]) -> tuple[float | None, float | None, int]:
    """Mean, half-range and count of the non-None values."""
    v = [x for x in values if x is not None]
    if not v:
        return None, None, 0
    return sum(v) / len(v), (max(v) - min(v)) / 2, len(v)


def eval_scores(evals: dict, run: str, point: str = "final") -> dict[str, float]:
    """``{task: acc}`` of one evaluation (empty if there is none)."""
    e = evals.get((run, point))
    if not e:
        return {}
    return {t: s["acc"] for t, s in e["result"]["tasks"].items() if isinstance(s, dict) and s.get("acc") is not None}


def eval_details(evals: dict, run: str, point: str = "final") -> dict[str, dict]:
    """``{task: {"acc", "stderr", "chance", "n"}}`` of one evaluation (empty if there is none)."""
    e = evals.get((run, point))
    if not e:
        return {}
    return {t: {"acc": s["acc"], "stderr": s.get("acc_stderr"), "chance": s.get("chance"), "n": s.get("n")}
            for t, s in e["result"]["tasks"].items() if isinstance(s, dict) and s.get("acc") is not None}


def combine_seeds(details: list[dict[str, dict]]) -> dict[str, dict]:
    """Per task over seeds: mean accuracy, the standard error of that mean (the seeds' binomial
    errors combined as independent: sqrt(sum se^2) / k), chance, and ``above`` = mean - 2 se > chance."""
    out = {}
    for t in sorted({t for d in details for t in d}):
        ds = [d[t] for d in details if t in d]
        mean = sum(x["acc"] for x in ds) / len(ds)
        ses = [x["stderr"] for x in ds if x["stderr"] is not None]
        se = (sum(v * v for v in ses) ** 0.5) / len(ses) if ses else None
        chance = ds[0]["chance"]
        above = None if se is None or chance is None else mean - 2 * se > chance
        out[t] = {"acc": mean, "stderr": se, "chance": chance, "above": above, "seeds": len(ds)}
    return out


def _mean_acc(scores: dict[str, float], tasks: list[str] | None = None) -> float | None:
    vals = [v for t, v in scores.items() if tasks is None or t in tasks]
    return sum(vals) / len(vals) if vals else None


def compare_rows(runs: list[dict], evals: dict, timing: dict | None = None) -> dict[str, list[dict]]:
    """Per size, one row per variant: accounting, val loss over seeds, loss ROI and paper ROI, and the
    step time measured side by side (``timing``, if measured)."""
    groups: dict[tuple[str, str], list[dict]] = defaultdict(list)
    order: list[str] = []
    for r in runs:
        if r["stage"] == "compare":
            key = (r["labels"]["size"], r["labels"]["variant"])
            groups[key].append(r)
            order += [] if r["labels"]["variant"] in order else [r["labels"]["variant"]]
    out: dict[str, list[dict]] = defaultdict(list)
    for (size, variant), rs in groups.items():
        loss, spread, n = mean_spread([r["metrics"]["final_val_loss"] for r in rs])
        scores = [eval_scores(evals, r["name"]) for r in rs]
        tasks = sorted({t for s in scores for t in s})
        a = rs[0]["accounting"]
        out[size].append({
            "size": size, "variant": variant, "seeds": [r["labels"]["seed"] for r in rs], "n": n,
            "val_loss": loss, "val_loss_spread": spread, "total_params": a["total_params"],
            "active_params": a["active_params"], "train_flops_per_token": a["train_flops_per_token"],
            "decode_bytes": a["decode_param_bytes_bf16"], "spikes": sum(r["metrics"]["loss_spikes"] for r in rs),
            "diverged": sum(r["status"] == "diverged" for r in rs),
            "train_seconds": mean_spread([r["metrics"]["train_seconds"] for r in rs])[0],
            "step_seconds": wall_from_timing(timing, size, variant),
            "step_vs_dense": (((timing or {}).get("sizes", {}).get(size) or {}).get(variant) or {}).get("vs_dense"),
            "unigram_entropy": rs[0]["data"]["unigram_entropy"],
            "acc": {t: mean_spread([s.get(t) for s in scores])[0] for t in tasks},
            "acc_detail": combine_seeds([eval_details(evals, r["name"]) for r in rs]),
            "mean_acc": mean_spread([_mean_acc(s) for s in scores])[0],
            "geometry": rs[0].get("geometry"), "capacity": rs[0].get("capacity"),
            "match": rs[0]["labels"].get("match"), "n_experts": a.get("n_experts"), "d_ff": a.get("d_ff"),
            "lr": rs[0]["labels"].get("lr") or rs[0]["config"]["optim"]["lr"],
            "knowledge": _probe_means(rs, "knowledge", ("train", "heldout", "question"))})
    for size, rows in out.items():
        rows.sort(key=lambda row: order.index(row["variant"]))
        dense = next((row for row in rows if row["variant"] == BASELINE), None)
        for row in rows:
            row["loss_roi"] = row["paper_roi"] = row["delta_vs_dense"] = None
            if dense is None or row["val_loss"] is None or dense["val_loss"] is None:
                continue
            row["delta_vs_dense"] = row["val_loss"] - dense["val_loss"]
            row["loss_roi"] = loss_roi(row["val_loss"], row["train_flops_per_token"], dense["val_loss"],
                                       dense["train_flops_per_token"], row["unigram_entropy"])
            if row["mean_acc"] is not None and dense["mean_acc"]:
                row["paper_roi"] = acc.roi(row["mean_acc"], row["train_flops_per_token"], dense["mean_acc"],
                                           dense["train_flops_per_token"])
    return dict(out)


def _probe_means(rs: list[dict], kind: str, families: tuple[str, ...]) -> dict[str, float]:
    """Mean over seeds of the knowledge probe's seen − unseen contrast per family (empty without probes)."""
    from .probes import knowledge_score, probe_of

    out = {}
    for family in families:
        vals = [knowledge_score(probe_of(r, kind), family) for r in rs]
        vals = [v for v in vals if v is not None]
        if vals:
            out[family] = sum(vals) / len(vals)
    return out


def curve_groups(runs: list[dict], stage: str = "compare", timing: dict | None = None) -> dict[str, dict[str, list[list[dict]]]]:
    """``{size: {variant: [val curve of each seed]}}`` (curves: dicts with flops, wall, val_loss). With
    ``timing``, a point's wall time is its step × the variant's step time measured side by side."""
    out: dict = defaultdict(lambda: defaultdict(list))
    for r in runs:
        if r["stage"] == stage:
            size, variant = r["labels"]["size"], r["labels"]["variant"]
            step_s = wall_from_timing(timing, size, variant)
            curve = r["metrics"]["val"] if step_s is None else [{**p, "wall": p["step"] * step_s} for p in r["metrics"]["val"]]
            out[size][variant].append(curve)
    return out


def mean_curve(curves: list[list[dict]], x_key: str) -> tuple[list[float], list[float]]:
    """Pointwise mean of the seeds' validation curves (over the points all of them reached)."""
    n = min(len(c) for c in curves)
    xs = [sum(c[i][x_key] for c in curves) / len(curves) for i in range(n)]
    ys = [sum(c[i]["val_loss"] for c in curves) / len(curves) for i in range(n)]
    return xs, ys


def stability_rows(runs: list[dict], settings: dict | None = None) -> list[dict]:
    """One row per (variant, lr) of the sweep (and of a version-1 ``stability`` stage): status
    (finished, collapsed or diverged), the robust detector's spikes, max train loss, final loss."""
    from .stability import DEFAULTS, run_stability

    st = {**DEFAULTS, **(settings or {})}
    rows = []
    for r in runs:
        if r["stage"] not in ("sweep", "stability"):
            continue
        m, s = r["metrics"], run_stability(r, st)
        rows.append({"variant": r["labels"]["variant"], "lr": r["labels"]["lr"], "seed": r["labels"].get("seed", 0),
                     "roles": r["labels"].get("roles", ["stress"]), "status": s["status"], "why": s["why"], "spikes": s["spikes"],
                     "steps": m["steps"], "max_train_loss": m.get("max_train_loss"), "final_val_loss": m["final_val_loss"],
                     "total_steps": r["config"]["run"]["steps"], "warmup_steps": s["warmup_steps"],
                     "train": m["train"], "unigram_entropy": s["unigram_entropy"]})
    return sorted(rows, key=lambda row: (row["variant"], row["lr"], row["seed"]))


def context_rows(runs: list[dict], evals: dict) -> list[dict]:
    """Per extended model (variant and seed): loss by position before/after extension, the needle
    probe and NIAH-like eval scores."""
    rows = []
    for r in runs:
        if r["stage"] != "context" or r["status"] != "finished":
            continue
        pos = r.get("position_loss") or {}
        rows.append({"variant": r["labels"]["variant"], "size": r["labels"]["size"], "seed": r["labels"].get("seed", 0),
                     "seq_len": pos.get("seq_len"), "init": pos.get("init"), "final": pos.get("final"),
                     "val_loss_init": r["metrics"]["val_loss_init"], "final_val_loss": r["metrics"]["final_val_loss"],
                     "name": r["name"], "needle": probe_of(r, "needle"),
                     "eval": evals.get((r["name"], "final"), {}).get("result", {}).get("tasks", {})})
    return rows


def control_rows(runs: list[dict]) -> list[dict]:
    """The positive controls: which probe, the run, and its probe result."""
    return [{"control": r["labels"]["control"], "name": r["name"], "status": r["status"],
             "final_val_loss": r["metrics"]["final_val_loss"],
             "probes": {k: p for k in ("knowledge", "needle") if (p := probe_of(r, k))}}
            for r in runs if r["stage"] == "controls"]


def midtrain_rows(runs: list[dict], evals: dict) -> list[dict]:
    """Per converted model: val loss at step 0 and at the end, eval scores at both points, the curve."""
    rows = []
    for r in runs:
        if r["stage"] != "midtrain":
            continue
        m = r["metrics"]
        rows.append({"variant": r["labels"]["variant"], "source": r["labels"]["source"], "status": r["status"],
                     "ffn": r["labels"].get("ffn"), "init": r["labels"].get("init"), "anneal": r["labels"].get("anneal"),
                     "seed": r["labels"].get("seed", 0),
                     "steps": m["steps"], "val_loss_init": m["val_loss_init"], "final_val_loss": m["final_val_loss"],
                     "total_params": r["accounting"]["total_params"],
                     "train_flops_per_token": r["accounting"]["train_flops_per_token"],
                     "acc_init": eval_scores(evals, r["name"], "init"), "acc_final": eval_scores(evals, r["name"]),
                     "detail_init": combine_seeds([eval_details(evals, r["name"], "init")]),
                     "detail_final": combine_seeds([eval_details(evals, r["name"])]),
                     "train": m["train"], "val": m["val"]})
    return rows


def bucket(values: list[float], n: int = 4) -> list[float]:
    """Means of ``n`` equal consecutive slices of ``values`` (loss by position, in quarters)."""
    size = max(1, len(values) // n)
    return [sum(values[i * size:(i + 1) * size]) / len(values[i * size:(i + 1) * size])
            for i in range(min(n, len(values))) if values[i * size:(i + 1) * size]]
