"""``report.md`` and its PNGs, generated from a study's result JSON only (``tables`` + ``plots``)."""

from __future__ import annotations

import json
from pathlib import Path

from . import plots
from .claims import claim_rows
from .tables import (bucket, compare_rows, context_rows, curve_groups, load_results, midtrain_rows,
                     stability_rows)
from .timing import load_timing
from ..accounting import human
from .measures import __doc__ as MEASURES_DOC


def _f(x, fmt: str = ".3f") -> str:
    return "–" if x is None else format(x, fmt)


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header), *("| " + " | ".join(r) + " |" for r in rows), ""]


def _img(path: Path | None, alt: str) -> list[str]:
    return [f"![{alt}]({path.name})", ""] if path else []


def _step_cell(r: dict) -> str:
    return f"{_f(r['step_seconds'])} ({_f(r['step_vs_dense'], '.2f')})" if r["step_seconds"] is not None else "–"


def _compare(rows_by_size: dict) -> list[str]:
    timed = any(r["step_seconds"] is not None for rows in rows_by_size.values() for r in rows)
    timing_note = ("Step s: median training step time measured side by side (`timing` stage: every variant in "
                   "turn, rounds rotating), and its median ratio to dense; the wall-time curves are step × that time."
                   if timed else "Train s: each run's own training time (runs train one after another; a busy "
                   "machine moves them: run the `timing` stage for a side-by-side measurement).")
    lines = ["## 1. Matched-budget comparison", "", timing_note, "",
             "Same tokens, data order and seeds for every variant. Val loss: mean ± half-range over seeds. "
             "Loss ROI = ((H − L)/F) / ((H − L_dense)/F_dense), H = unigram entropy of the corpus, F = training "
             "FLOPs per token; accuracy ROI = (acc/F) / (acc_dense/F_dense) with the mean eval accuracy (Table 3).", ""]
    for size, rows in rows_by_size.items():
        lines += [f"### size {size} (unigram entropy {rows[0]['unigram_entropy']:.3f} nats/token)", ""]
        lines += _table(
            ["variant", "total params", "active params", "train FLOPs/token", "decode bytes (bf16)", "val loss",
             "Δ vs dense", "loss ROI", "acc ROI", "mean acc", "spikes", "step s (× dense)" if timed else "train s"],
            [[r["variant"], human(r["total_params"]), human(r["active_params"]), human(r["train_flops_per_token"]),
              human(r["decode_bytes"], "B"),
              (f"{_f(r['val_loss'])} ± {_f(r['val_loss_spread'])} (n={r['n']})" if r["n"] > 1
               else f"{_f(r['val_loss'])} (n=1)") + (f", {r['diverged']} diverged" if r["diverged"] else ""),
              _f(r["delta_vs_dense"], "+.3f"), _f(r["loss_roi"]), _f(r["paper_roi"]), _f(r["mean_acc"]),
              str(r["spikes"]), _step_cell(r) if timed else _f(r["train_seconds"], ".0f")] for r in rows])
        matched = [r for r in rows if r["match"]]
        if matched:
            lines += ["Parameter matching (total parameters, `stemlm.accounting`):", ""]
            lines += _table(["variant", "matched by", "total", "reference", "reference total", "ratio"],
                            [[r["variant"], f"n_experts={r['n_experts']}" if r["n_experts"] else f"d_ff={r['d_ff']}",
                              human(r["match"]["total_params"]), r["match"]["reference"],
                              human(r["match"]["reference_total_params"]), f"{r['match']['ratio']:.4f}"] for r in matched])
        geo = [r for r in rows if r["geometry"]]
        if geo:
            lines += ["Table geometry (mean |cos| between rows of distinct tokens, mean over table layers; "
                      "random vectors give the reference) and capacity (distinct tokens in one training window):", ""]
            lines += _table(["variant", "table rows mean |cos|", "random ref.", "distinct tokens / window",
                             "table params activated / window"],
                            [[r["variant"], _f(_layer_mean(r["geometry"], "stem_rows_mean_abs_cos")),
                              _f(r["geometry"]["random_mean_abs_cos"]),
                              _f((r["capacity"] or {}).get("unique_tokens_at_seq_len"), ".1f"),
                              human((r["capacity"] or {}).get("table_params_activated_at_seq_len") or 0)] for r in geo])
        tasks = sorted({t for r in rows for t in r["acc"]})
        if tasks:
            lines += ["Eval accuracy (`stemlm eval`): mean over seeds ± its standard error; **bold** = above chance "
                      "(mean − 2 se > chance); chance in the last row.", ""]
            lines += _table(["variant", *tasks], [[r["variant"], *(_acc_cell(r["acc_detail"].get(t)) for t in tasks)]
                                                  for r in rows])
            chance = {t: next((r["acc_detail"][t]["chance"] for r in rows if t in r["acc_detail"]), None) for t in tasks}
            lines = lines[:-1] + ["| chance | " + " | ".join(_f(chance[t]) for t in tasks) + " |", ""]
    return lines


def _acc_cell(d: dict | None) -> str:
    """``acc ± se``, bold when above chance."""
    if not d:
        return "–"
    cell = f"{d['acc']:.3f} ± {_f(d['stderr'])}"
    return f"**{cell}**" if d["above"] else cell


def _layer_mean(geometry: dict, key: str) -> float | None:
    vals = [layer[key] for layer in geometry["layers"] if key in layer]
    return sum(vals) / len(vals) if vals else None


def _stability(rows: list[dict]) -> list[str]:
    if not rows:
        return []
    return ["## 2. Stability under stress (peak learning-rate sweep)", "",
            "Spikes: steps whose loss exceeds the trainer's threshold (`run.spike_factor` × running median). "
            "Diverged: the trainer stopped on a non-finite loss or gradient norm.", "",
            *_table(["variant", "peak lr", "status", "steps", "spikes", "max train loss", "final val loss"],
                    [[r["variant"], f"{r['lr']:g}", r["status"], f"{r['steps']}/{r['total_steps']}", str(r["spikes"]),
                      _f(r["max_train_loss"]), _f(r["final_val_loss"])] for r in rows])]


def _context(rows: list[dict]) -> list[str]:
    if not rows:
        return []
    lines = ["## 3. Context extension", "",
             "`run.stage=context_extend` with document masking, from the comparison run of the same variant. "
             "Validation loss by position (window quarters, plain causal attention over the whole window), "
             "before (the starting checkpoint at the long length) and after the extension:", ""]
    body = []
    for r in rows:
        for point in ("init", "final"):
            if r[point]:
                body.append([r["variant"], "before" if point == "init" else "after", str(r["seq_len"]),
                             *(_f(x) for x in bucket(r[point])), _f(sum(r[point]) / len(r[point]))])
    lines += _table(["variant", "", "length", "Q1", "Q2", "Q3", "Q4", "mean"], body)
    niah = [(r, t, s) for r in rows for t, s in r["eval"].items()]
    if niah:
        lines += _table(["variant", "task", "acc", "n"], [[r["variant"], t, _f(s.get("acc")), str(s.get("n", "–"))]
                                                          for r, t, s in niah])
    return lines


def _midtrain(rows: list[dict]) -> list[str]:
    if not rows:
        return []
    tasks = sorted({t for r in rows for t in (*r["acc_init"], *r["acc_final"])})
    lines = ["## 4. Mid-training insertion on a real model", "",
             "The converted model (STEM tables initialised by `project`) and its dense original, trained with "
             "the same tokens and learning rate on the default corpus in the model's own tokenizer.", ""]
    lines += _table(["variant", "total params", "train FLOPs/token", "status", "steps", "val loss step 0", "val loss end",
                     *(f"{t} 0 → end" for t in tasks)],
                    [[r["variant"], human(r["total_params"]), human(r["train_flops_per_token"]), r["status"], str(r["steps"]),
                      _f(r["val_loss_init"]), _f(r["final_val_loss"]),
                      *(f"{_acc_cell(r['detail_init'].get(t))} → {_acc_cell(r['detail_final'].get(t))}" for t in tasks)] for r in rows])
    return lines


def write_report(results_dir: str | Path, out_dir: str | Path | None = None) -> Path:
    """Write ``report.md`` and the PNGs into ``out_dir`` (default: the results dir); returns the report path."""
    results_dir = Path(results_dir)
    out = Path(out_dir) if out_dir else results_dir
    runs, evals = load_results(results_dir)
    if not runs:
        raise FileNotFoundError(f"{results_dir}/runs holds no run results")
    meta_file = results_dir / "study.json"
    meta = json.loads(meta_file.read_text()) if meta_file.exists() else {}
    timing = load_timing(results_dir)
    compare = compare_rows(runs, evals, timing)
    stab, ctx, mid = stability_rows(runs), context_rows(runs, evals), midtrain_rows(runs, evals)
    commits = sorted({r.get("git_commit") or "unknown" for r in runs})
    lines = [f"# Study {meta.get('name', results_dir.name)}", "",
             f"Generated by `stemlm study report` from {len(runs)} run results and {len(evals)} eval results "
             f"(git commit{'s' if len(commits) > 1 else ''} {', '.join(c[:10] for c in commits)}). "
             f"Runs by status: {_status_counts(runs)}.", ""]
    lines += _claims(claim_rows(runs, evals, timing))
    lines += _compare(compare)
    for path in plots.loss_curves(curve_groups(runs, timing=timing), out, timed=timing is not None):
        lines += _img(path, path.stem)
    lines += _img(plots.roi_bars(compare, out), "ROI")
    lines += _stability(stab) + _img(plots.spikes_vs_lr(stab, out), "spikes vs lr")
    lines += _context(ctx) + _img(plots.loss_by_position(ctx, out), "loss by position") + _img(plots.niah_grid(ctx, out), "NIAH")
    lines += _midtrain(mid) + _img(plots.midtrain_curves(mid, out), "mid-training loss")
    lines += ["## Definitions", "", "```", MEASURES_DOC.strip(), "```", ""]
    out.mkdir(parents=True, exist_ok=True)
    path = out / "report.md"
    path.write_text("\n".join(lines))
    return path


def _claims(rows: list[dict]) -> list[str]:
    if not rows:
        return []
    return ["## The paper's claims", "", "Each verdict follows the rule in its row (`stemlm/study/claims.py`).", "",
            *_table(["claim", "paper", "measured here", "verdict", "rule"],
                    [[r["claim"], r["paper"], r["measured"], f"**{r['verdict']}**", r["rule"]] for r in rows])]


def _status_counts(runs: list[dict]) -> str:
    counts: dict[str, int] = {}
    for r in runs:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    return ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
