"""Sections of ``report.md`` after the comparison: tuning, stability, probes, context, mid-training.

Each function takes rows aggregated from the result JSON (``tables``) and returns markdown lines.
"""

from __future__ import annotations

import math

from ..accounting import human


def f(x, fmt: str = ".3f") -> str:
    """A number for a table cell (– for None)."""
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    """A markdown table followed by a blank line."""
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header), *("| " + " | ".join(r) + " |" for r in rows), ""]


def tuning(sweep: dict[str, dict[float, dict]], best: dict[str, dict], steps: int | None) -> list[str]:
    """The lr sweep: final validation loss of each variant at each lr, the best bold, edges flagged."""
    if not sweep:
        return []
    lrs = sorted({lr for cells in sweep.values() for lr in cells})
    lines = ["## 1. Equal tuning: the learning-rate sweep", "",
             f"Every variant at every peak lr of the grid, the same seeds{f', {steps} steps' if steps else ''}, the same "
             "optimizer setting; the best lr of each variant (lowest mean final validation loss; bold) is the one its "
             "comparison runs use. ◂ / ▸: the best lr is the grid's smallest / largest and no worse run lies beyond it (the optimum may lie outside). "
             "Cells without a tuning role are the stability stage's extra lrs. With `sweep.resolve`, lrs past an edge are "
             "tried and the lrs near the best get more seeds (n = seeds averaged).", ""]
    body = []
    for variant, cells in sweep.items():
        b = best.get(variant, {})
        row = [variant]
        for lr in lrs:
            c = cells.get(lr)
            if c is None:
                row.append("")
                continue
            text = "diverged" if math.isinf(c["loss"]) else f"{c['loss']:.3f}"
            text += f" (n={len(c['losses'])})" if len(c["losses"]) > 1 else ""
            text = f"**{text}**" if b.get("lr") == lr else text
            tuned_on = lr in b["grid"] if b.get("grid") else "tune" in c["roles"]  # the spec's grid decides, not the run's label
            row.append(text + ("" if tuned_on else " (stress)"))
        edge = {"low": " ◂", "high": " ▸"}.get(b.get("edge"), "")
        body.append(row + [f"{b['lr']:g}{edge}" if b else "–"])
    lines += table(["variant", *(f"lr {lr:g}" for lr in lrs), "best"], body)
    confirmed = {v: b["confirmed"] for v, b in best.items() if b.get("confirmed")}
    if confirmed:
        lines += ["", "Confirmed at the comparison's length (`sweep.resolve.confirm_steps`): the candidates near each "
                  "best, trained as long as the comparison, and the lowest final validation loss there is the pick:", ""]
        lines += [f"- {v}: " + ", ".join(f"lr {lr:g} {loss:.3f}" for lr, loss in sorted(c.items()))
                  + f" → {best[v]['lr']:g}" for v, c in confirmed.items()]
    return lines


def stability(rows: list[dict], settings: dict) -> list[str]:
    """Spikes (robust detector), collapse and divergence of every sweep run."""
    if not rows:
        return []
    st = settings
    lines = ["## 3. Stability: spikes, collapse, divergence over the sweep", "",
             f"Spike: a step (after warm-up + {st['settle']} steps) whose loss exceeds the mean of the previous "
             f"{st['average']} steps by more than {st['k']:g} σ, σ = 1.4826 · MAD of the step-to-step changes over the "
             f"previous {st['spread']} steps / √2 (at least {st['floor']:g} nats). Status from the training loss "
             f"(`stemlm/study/stability.py`): diverged = stopped on a non-finite value, or exploded above ln V + "
             f"{st['explode']:g} and stayed worse than uniform; collapsed = back at (or never below) H − "
             f"{st['collapse_eps']:g} and flat over the last quarter; slow start = above H − {st['collapse_eps']:g} at "
             "the end but still falling. An explosion the run recovered from is noted. These sweep runs have one seed "
             "and a warm-up of 1–2 steps; spikes here include the data's own bumps (every seed-0 run sees the same "
             "batches), so (c) is judged on the comparison runs instead, each paired with dense's run of its seed. "
             "Every spike is circled in the curves below.", ""]
    lines += table(["variant", "peak lr", "seed", "status", "steps", "spikes (step: loss / level)", "max train loss",
                    "final val loss"],
                   [[r["variant"], f"{r['lr']:g}", str(r["seed"]), r["status"] + (f" ({r['why']})" if r.get("why") else ""),
                     f"{r['steps']}/{r['total_steps']}",
                     (f"{len(r['spikes'])}: " + ", ".join(f"{s['step']}: {s['loss']:.2f}/{s['level']:.2f}"
                                                         for s in r["spikes"][:4]) + (" …" if len(r["spikes"]) > 4 else ""))
                     if r["spikes"] else "0", f(r["max_train_loss"]), f(r["final_val_loss"])] for r in rows])
    return lines


def knowledge(rows_by_size: dict, controls: list[dict]) -> list[str]:
    """The knowledge probe per variant (mean over seeds) and its positive control."""
    rows = [(size, r) for size, rs in rows_by_size.items() for r in rs if r.get("knowledge")]
    if not rows:
        return []
    lines = ["## 4. Knowledge probe (log-probabilities)", "",
             "Per fact: log p(gold answer | prompt) − log p(same answer | the prompt about a never-trained country). "
             "Cells: mean over seen facts − mean over unseen ones (nats), mean over seeds; > 0 means the model stored "
             "facts it read. Families: the training templates, the held-out template, the question phrasing.", ""]
    lines += table(["size", "variant", "training templates", "held-out template", "question"],
                   [[size, r["variant"], *(f(r["knowledge"].get(k), "+.3f") for k in ("train", "heldout", "question"))]
                    for size, r in rows])
    for c in controls:
        k = (c["probes"] or {}).get("knowledge")
        if k and k.get("families"):
            fam = k["families"]
            lines += [f"Positive control `{c['name']}` (trained on the facts alone): " + ", ".join(
                f"{name} {v['seen'] - v['unseen']:+.3f}" for name, v in fam.items()) + " nats.", ""]
    return lines


def _needle_cells(probes: list[dict], lengths: list[int]) -> list[str]:
    """Mean over ``probes`` of the by-length margin (gain for an earlier probe), and greedy retrieval."""
    cells = [f(sum(p["by_length"][str(n)]["mean"] for p in probes) / len(probes), "+.3f") for n in lengths]
    found = [p["retrieved"]["mean"] for p in probes if p.get("retrieved")]
    return cells + [f"{sum(found) / len(found):.0%}" if found else "–"]


def context(rows: list[dict], controls: list[dict]) -> list[str]:
    """Loss by position in quarters and the needle probe's retrieval, mean over seeds, per variant."""
    if not rows:
        return []
    from .tables import bucket

    lines = ["## 5. Context extension", "",
             "`run.stage=context_extend` with document masking, from the comparison run of the same variant and seed. "
             "Validation loss by position (window quarters, mean over seeds), before and after the extension; then the "
             "needle probe: the pass key's log-probability minus a decoy number's (\"The room number is D\", twice, "
             "like the key) after the question, in nats — repeating numbers seen in context favours both alike, only "
             "retrieval favours the key — and the fraction of keys retrieved greedily. Earlier probe versions had no "
             "decoy: their columns are the needle's gain (key log-prob with − without the needle).", ""]
    body, scores = [], []
    for variant in dict.fromkeys(r["variant"] for r in rows):
        rs = [r for r in rows if r["variant"] == variant]
        for point in ("init", "final"):
            if all(r[point] for r in rs):
                n = min(len(r[point]) for r in rs)
                curve = [sum(r[point][j] for r in rs) / len(rs) for j in range(n)]
                body.append([variant, "before" if point == "init" else "after", str(rs[0]["seq_len"]), str(len(rs)),
                             *(f(x) for x in bucket(curve)), f(sum(curve) / n)])
        probes = [r["needle"] for r in rs if r.get("needle")]
        if probes:
            scores.append([variant, str(len(probes)), *_needle_cells(probes, probes[0]["lengths"])])
    lines += table(["variant", "", "length", "seeds", "Q1", "Q2", "Q3", "Q4", "mean"], body)
    for c in controls:
        if (p := (c["probes"] or {}).get("needle")):
            scores.append([f"control: {c['name']}", "1", *_needle_cells([p], p["lengths"])])
    if scores:
        first = next(r["needle"] for r in rows if r.get("needle"))
        measure = "margin" if first.get("version", 1) >= 2 else "gain"
        lines += table(["model", "seeds", *(f"{measure} at {n} tokens" for n in first["lengths"]), "greedy retrieval"],
                       scores)
    return lines


def midtrain(rows: list[dict], acc_cell) -> list[str]:
    """Each mid-training arm: labels, val loss at step 0 and at the end, eval scores at both points."""
    if not rows:
        return []
    tasks = sorted({t for r in rows for t in (*r["acc_init"], *r["acc_final"])})
    lines = ["## 6. Mid-training insertion on a real model", "",
             "Each arm starts from the same converted model and trains on the same tokens, lr and schedule, in the "
             "model's own tokenizer; arms are named by their labels (FFN, table init, gradual insertion).", ""]
    lines += table(["arm", "ffn", "init", "anneal", "seed", "total params", "status", "steps", "val loss step 0",
                    "val loss end", *(f"{t} 0 → end" for t in tasks)],
                   [[r["variant"], str(r.get("ffn") or "–"), str(r.get("init") or "–"), str(r.get("anneal") or "–"),
                     str(r["seed"]), human(r["total_params"]), r["status"], str(r["steps"]), f(r["val_loss_init"]),
                     f(r["final_val_loss"]),
                     *(f"{acc_cell(r['detail_init'].get(t))} → {acc_cell(r['detail_final'].get(t))}" for t in tasks)]
                    for r in rows])
    return lines
