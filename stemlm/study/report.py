"""``report.md`` and its PNGs, generated from a study's result JSON only (``tables`` + ``plots``)."""

from __future__ import annotations

import json
from pathlib import Path

from ..runtime.files import atomic_write_text
from . import plots, sections
from .claims import claim_rows, verdict_cell
from .dynamics import gap_curves, gap_trend, val_curves
from .evidence import PLACEMENTS
from .paper import TABLE2
from .sections import f as _f, table as _table
from .stability import DEFAULTS as SPIKE_DEFAULTS
from .stats import RULE
from .tables import compare_rows, context_rows, control_rows, curve_groups, load_results, midtrain_rows, stability_rows
from .timing import load_timing
from .tuning import best_lrs, is_confirm, pick, sweep_table
from ..accounting import human
from .measures import __doc__ as MEASURES_DOC


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
    lines = ["## 2. Matched-budget comparison", "", timing_note, "",
             "Each variant at its best sweep lr (lr column); seed s fixes the init and the data order of every variant's "
             "run s. Val loss: mean ± half-range over seeds. "
             "Loss ROI = ((H − L)/F) / ((H − L_dense)/F_dense), H = unigram entropy of the corpus, F = training "
             "FLOPs per token; accuracy ROI = (acc/F) / (acc_dense/F_dense) with the mean eval accuracy (Table 3).", ""]
    for size, rows in rows_by_size.items():
        lines += [f"### size {size} (unigram entropy {rows[0]['unigram_entropy']:.3f} nats/token)", ""]
        lines += _table(
            ["variant", "lr", "total params", "active params", "train FLOPs/token", "decode bytes (bf16)", "val loss",
             "Δ vs dense", "loss ROI", "acc ROI", "mean acc", "step s (× dense)" if timed else "train s"],
            [[r["variant"], _f(r["lr"], "g"), human(r["total_params"]), human(r["active_params"]),
              human(r["train_flops_per_token"]), human(r["decode_bytes"], "B"),
              (f"{_f(r['val_loss'])} ± {_f(r['val_loss_spread'])} (n={r['n']})" if r["n"] > 1
               else f"{_f(r['val_loss'])} (n=1)") + (f", {r['diverged']} diverged" if r["diverged"] else ""),
              _f(r["delta_vs_dense"], "+.3f"), _f(r["loss_roi"]), _f(r["paper_roi"]), _f(r["mean_acc"]),
              _step_cell(r) if timed else _f(r["train_seconds"], ".0f")] for r in rows])
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
                      "(mean − 2 se > chance); chance in the last row. Where every score is at chance the accuracy "
                      "ROI above only restates the FLOP ratio.", ""]
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


def write_report(results_dir: str | Path, out_dir: str | Path | None = None) -> Path:
    """Write ``report.md`` and the PNGs into ``out_dir`` (default: the results dir); returns the report path."""
    results_dir = Path(results_dir)
    out = Path(out_dir) if out_dir else results_dir
    runs, evals = load_results(results_dir)
    if not runs:
        raise FileNotFoundError(f"{results_dir}/runs holds no run results")
    meta_file = results_dir / "study.json"
    meta = json.loads(meta_file.read_text()) if meta_file.exists() else {}
    settings = report_settings(meta.get("spec") or {})
    timing = load_timing(results_dir)
    compare = compare_rows(runs, evals, timing)
    stab, ctx, mid = stability_rows(runs, settings["spikes"]), context_rows(runs, evals), midtrain_rows(runs, evals)
    controls = control_rows(runs)
    commits = sorted({r.get("git_commit") or "unknown" for r in runs})
    lines = [f"# Study {meta.get('name', results_dir.name)}", "",
             f"Generated by `stemlm study report` from {len(runs)} run results and {len(evals)} eval results "
             f"(git commit{'s' if len(commits) > 1 else ''} {', '.join(c[:10] for c in commits)}). "
             f"Runs by status: {_status_counts(runs)}.", "", _dirty_line(runs), ""]
    rows = claim_rows(runs, evals, timing, settings)
    lines += _claims(rows)
    if (other := (meta.get("spec") or {}).get("compare_with")) and (REPO / other / "runs").is_dir():
        lines += _two_scales(rows, meta.get("name", results_dir.name), REPO / other)
    sweep_steps = next((r["config"]["run"]["steps"] for r in runs if r["stage"] == "sweep" and not is_confirm(r)), None)
    sweep_runs = [r for r in runs if r["stage"] == "sweep"]
    best = (pick(sweep_runs, settings["sweep"])[0] if settings["sweep"].get("lrs")
            else best_lrs(sweep_runs, settings["grid"] or None))
    lines += sections.tuning(sweep_table(runs), best, sweep_steps)
    lines += _compare(compare)
    for path in plots.loss_curves(curve_groups(runs, timing=timing), out, timed=timing is not None):
        lines += _img(path, path.stem)
    lines += _img(plots.roi_bars(compare, out), "ROI")
    lines += _dynamics(runs, out)
    lines += sections.stability(stab, settings["spikes"]) + _img(plots.spikes_vs_lr(stab, out), "spikes vs lr")
    lines += _img(plots.stability_curves(stab, out), "every step of the sweep")
    lines += sections.knowledge(compare, controls)
    lines += sections.context(ctx, controls) + _img(plots.loss_by_position(ctx, out), "loss by position")
    needle_rows = ctx + [{"variant": f"control {c['name']}", "needle": c["probes"].get("needle")} for c in controls]
    lines += _img(plots.needle_gain_grid(needle_rows, out), "needle gain")
    lines += _img(plots.niah_grid(ctx, out), "NIAH")
    lines += sections.midtrain(mid, _acc_cell) + _img(plots.midtrain_curves(mid, out), "mid-training loss")
    lines += ["## Definitions", "", "```", MEASURES_DOC.strip(), "```", ""]
    out.mkdir(parents=True, exist_ok=True)
    path = out / "report.md"
    atomic_write_text(path, "\n".join(lines))
    return path


def report_settings(spec: dict) -> dict:
    """What the report needs of the spec: spike settings, the paper's lr, the tuning grid."""
    from .stability import spike_settings

    return {"spikes": spike_settings(spec) if spec else dict(SPIKE_DEFAULTS), "paper_lr": TABLE2["lr"],
            "grid": [float(x) for x in (spec.get("sweep") or {}).get("lrs") or []], "sweep": spec.get("sweep") or {}}


def _dynamics(runs: list[dict], out: Path) -> list[str]:
    """The gap to dense against tokens, per placement, with its trend."""
    epoch = next((r["data"].get("train_tokens") for r in runs if r["stage"] == "compare"), None)
    trends = {}
    for size, curves in val_curves(runs).items():
        trends[size] = {}
        for p in PLACEMENTS:
            gaps = gap_curves(curves, p)
            if gaps and (t := gap_trend(gaps, epoch_tokens=epoch)) is not None:
                trends[size][p] = {**t, "seeds": gaps}
    if not any(trends.values()):
        return []
    lines = ["### Training dynamics: the gap to dense", "",
             "Validation loss of each placement minus dense's (same seed) at every evaluation; slope of a line on "
             "log₂ tokens over the second half of training, per seed, mean with its 95 % interval.", ""]
    lines += _table(["size", "variant", "gap first", "at tokens", "gap end", "at tokens", "slope (nats/doubling)",
                     "crosses 0 at"],
                    [[size, v, _f(t["gap_first"], "+.3f"), human(t["tokens_first"]), _f(t["gap_end"], "+.3f"),
                      human(t["tokens_end"]), _slope_cell(t["slope"]),
                      (human(t["cross_tokens"]) + (f" ({t['cross_epochs']:.1f} epochs)" if t["cross_epochs"] else ""))
                      if t["cross_tokens"] else "never (on this trend)"] for size, ts in trends.items() for v, t in ts.items()])
    return lines + _img(plots.gap_vs_tokens(trends, out), "gap vs tokens")


def _slope_cell(d: dict) -> str:
    return (f"{d['mean']:+.3f} [{d['ci'][0]:+.3f}, {d['ci'][1]:+.3f}]" if d.get("ci") else f"{d['mean']:+.3f} (n={d['n']})")


def _claims(rows: list[dict]) -> list[str]:
    if not rows:
        return []
    return ["## The paper's claims", "",
            f"Verdict rule (`stemlm/study/stats.py`): {RULE}. Each row's comparison and its intervals are in "
            "`measured`; the per-claim rule says what is compared (`stemlm/study/claims.py`).", "",
            *_table(["claim", "paper (source)", "measured here: difference [95 % interval], MDE", "verdict, scale, what "
                     "would settle it", "compared"],
                    [[r["claim"], r["paper"], r["measured"], verdict_cell(r), r["rule"].split(". ")[0]]
                     for r in rows])]


REPO = Path(__file__).resolve().parents[2]


def _two_scales(rows: list[dict], name: str, other: Path) -> list[str]:
    """Claims (a) and (a′) of this study beside those of the study in ``other`` (the spec's ``compare_with``):
    each comparison with its scale, so the gap to dense is read against tokens across both."""
    o_runs, o_evals = load_results(other)
    o_meta = json.loads((other / "study.json").read_text()) if (other / "study.json").exists() else {}
    o_rows = claim_rows(o_runs, o_evals, load_timing(other), report_settings(o_meta.get("spec") or {}))
    body = []
    for key in ("roi", "dynamics"):
        for label, rs in ((o_meta.get("name", other.name), o_rows), (name, rows)):
            row = next((r for r in rs if r["key"] == key), None)
            if row is None:
                continue
            scale = (row["scale"] or {}).get("text", "–")
            body += [[row["claim"].split(" ")[0], label, scale, p["label"], p["text"], p["verdict"]] for p in row["parts"]]
    if not body:
        return []
    return ["### (a) and (a′) at both scales", "",
            f"This study beside `{other.relative_to(REPO)}`: the same comparisons (Holm-corrected within each study), "
            "each with the tokens it was measured at.", "",
            *_table(["claim", "study", "scale", "comparison", "measured", "verdict"], body)]


def _dirty_line(runs: list[dict]) -> str:
    """How many runs of each stage were trained from a checkout with uncommitted changes (``git_dirty``): their
    recorded commit does not reproduce them."""
    stages = dict.fromkeys(r["stage"] for r in runs)
    cells = []
    for st in stages:
        rs = [r for r in runs if r["stage"] == st]
        dirty = [r for r in rs if r.get("git_dirty")]
        cells.append(f"{st} {len(dirty)} of {len(rs)} ({_commits(rs)})")
    total = sum(bool(r.get("git_dirty")) for r in runs)
    return (f"**Reproducibility**: {total} of {len(runs)} runs were trained from a checkout with uncommitted changes "
            f"(`git_dirty`), so their recorded commit does not reproduce them — by stage: {', '.join(cells)}. "
            "The runner now refuses a dirty checkout (`--allow-dirty` to override); re-running those runs from a clean "
            "commit is what would fix it." if total else
            f"**Reproducibility**: all {len(runs)} runs were trained from clean checkouts "
            f"({_commits(runs)}).")


def _commits(runs: list[dict]) -> str:
    n = len({r.get("git_commit") for r in runs})
    return f"{n} commit{'s' if n != 1 else ''}"


def _status_counts(runs: list[dict]) -> str:
    counts: dict[str, int] = {}
    for r in runs:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    return ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
