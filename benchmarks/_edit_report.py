"""The real-model edit parts of docs/insertion.md (used by ``insertion_report.py``).

Reads ``benchmarks/results/edit_trace.json`` (``bench_edit_trace.py``: where the dense model keeps its
capitals) and ``benchmarks/results/edit_real*.json`` (``bench_edit_real.py``: row swaps with STEM placed
at sets of layers; ``edit_real.json`` converts layers 1..29, a tagged file other layers, e.g. layer 0).
"""

from __future__ import annotations

import json
from pathlib import Path

from stemlm.runtime.plotting import save

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
TRACE = RESULTS / "edit_trace.json"
PLOTS = ROOT / "results" / "insertion"
EDIT_FLIP_GOAL, EDIT_LOCALITY_GOAL = 0.80, 0.99
KIND_LABELS = {"up": "up-projection `W_u x`", "ffn": "FFN output", "resid": "residual stream entering the layer"}


def edit_sections() -> list[str]:
    """Every edit part whose results exist: the trace, then one table per ``edit_real*.json``."""
    out = trace_section(json.loads(TRACE.read_text())) if TRACE.exists() else []
    for path in sorted(RESULTS.glob("edit_real*.json")):
        data = json.loads(path.read_text())
        # edits of a mid-trained checkpoint (edit_real.midtrain-kd-307k.json) have no conversion placements to
        # tabulate; the text before the generated section quotes them
        if ".quick" not in path.name and "placements" in data:
            out += edit_section(data, path.name)
    return out


def trace_section(data: dict) -> list[str]:
    splits = data["splits"]
    held = splits["heldout_template"]
    out = ["", "### Where SmolLM2-135M keeps its capitals (activation patching)", "",
           "`python benchmarks/bench_edit_trace.py` (`stemlm.edit.trace`): on the *dense* model, pairs of capital "
           "questions it answers right, same template and token length (\"The capital of Spain is\" / \"… Germany "
           "is\"); the other country's activations at the subject's tokens are put into the subject's prompt at a "
           "set of layers. *Flip* = the other country's capital becomes the top-1 answer (95% Wilson interval). "
           "Patching the up-projection is the ceiling of a row swap in a model converted from this one (rows equal "
           "to the dense up-projection at this very context; calibrated rows average over contexts); the FFN output "
           "the ceiling of a table of whole FFN outputs; the residual stream entering layer 0 is the input "
           "embedding, i.e. renaming the token — the positive control, not an edit.", "",
           f"Cases: {held['cases']} held-out-phrasing pairs over {held['countries']} countries, "
           f"{splits['train']['cases']} training-phrasing pairs over {splits['train']['countries']}.", "",
           "| patched at (layers) | up-projection, held-out | FFN output, held-out | up-projection, training phrasing | FFN output, training phrasing |",
           "|---|---:|---:|---:|---:|"]
    labels = [k for k in held["kinds"]["up"] if not k.isdigit()] + ["0"]
    for label in labels:
        layers = data["placements"].get(label, [int(label)] if label.isdigit() else [])
        name = f"{label} ({_layers(layers)})" if not label.isdigit() else f"layer {label} only"
        cells = [_flip(splits[s]["kinds"][k].get(label)) for s in ("heldout_template", "train") for k in ("up", "ffn")]
        out.append(f"| {name} | " + " | ".join(cells) + " |")
    emb = {s: splits[s]["kinds"]["resid"].get("0") for s in splits}
    out += ["", "Control: the residual stream entering layer 0 (the input embedding) flips "
            f"{_flip(emb['heldout_template'])} held-out and {_flip(emb['train'])} training-phrasing cases."]
    singles = {k: {int(i): r for i, r in held["kinds"][k].items() if i.isdigit()} for k in ("up", "ffn", "resid")}
    top = sorted(singles["up"], key=lambda i: -singles["up"][i]["flip"])[:3]
    out += ["", "Single layers, up-projection (held-out): " +
            ", ".join(f"layer {i} {singles['up'][i]['flip']:.0%}" for i in top) + "; the residual stream at the "
            "subject still flips the answer until layer " + str(_last_over(singles["resid"], 0.5)) + " (last layer "
            "with ≥ 50% flips)."]
    plot = plot_trace(singles)
    if plot:
        out += ["", f"![activation patching per layer]({Path('..') / plot.relative_to(ROOT)})"]
    return out


def _layers(layers: list[int]) -> str:
    if layers and layers == list(range(layers[0], layers[-1] + 1)) and len(layers) > 2:
        return f"{layers[0]}–{layers[-1]}"
    return ",".join(map(str, layers))


def _flip(r: dict | None) -> str:
    if not r or r.get("flip") is None:
        return "–"
    lo, hi = r["flip_ci"]
    return f"{r['flip']:.0%} [{lo:.0%}, {hi:.0%}]"


def _last_over(rows: dict[int, dict], level: float) -> int | None:
    over = [i for i, r in rows.items() if (r["flip"] or 0) >= level]
    return max(over) if over else None


def plot_trace(singles: dict[str, dict[int, dict]]) -> Path | None:
    plt = pyplot_or_none()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(9, 3.4))
    for kind, rows in singles.items():
        layers = sorted(rows)
        ax.plot(layers, [rows[i]["flip"] for i in layers], marker="o", ms=3, label=KIND_LABELS[kind])
    ax.axhline(EDIT_FLIP_GOAL, color="grey", ls="--", lw=0.8, label=f"edit goal ({EDIT_FLIP_GOAL:.0%})")
    ax.set(xlabel="layer patched (alone)", ylabel="flipped to the other capital", ylim=(-0.02, 1.02),
           title="SmolLM2-135M: the other country's activations at the subject's tokens (held-out phrasings)")
    ax.legend(fontsize=8)
    return save(fig, PLOTS / "edit_trace.png", dpi=110)


def edit_section(data: dict, name: str = "edit_real.json") -> list[str]:
    pl = data["placements"]
    converted = data.get("table_layers") or list(range(1, 30))
    tag = name.removeprefix("edit_real").removesuffix(".json").strip(".")
    title = "Editing a real model's facts by rows (SmolLM2-135M)" + (f", tables at layers {_layers(converted)}"
                                                                    if tag else "")
    title += "".join(f", {part}" for part in edit_settings(data))
    unseen = data.get("calib_unseen", "pooled")
    flags = (f" --table-layers {data.get('table_spec', '')}" if tag else "") + "".join(
        f" --{key.replace('_', '-')}" + ("" if value is True else f" {value}") for key, value in changed(data).items())
    out = ["", f"### {title}", "",
           f"`python benchmarks/bench_edit_real.py{flags}`: "
           "the dense model with STEM placed at a set of layers (calibrated "
           f"rows, {data['calib_tokens']:,} calibration tokens, fitted on the dense activations; ids the calibration "
           f"never shows get the {unseen} row), {data['pairs']} country "
           "pairs, capitals; a pair's rows are swapped in the placed layers and every known capital question of each "
           "country is asked. *Knows* = capital questions the placed model answers right (top-1 first token) of those asked; "
           "*edited facts* = facts of the edit pairs it answers right for both countries before the edit; *flip* = the "
           "other country's capital is the top-1 answer after it; locality = other countries' top-1 answers "
           f"unchanged ({data['locality']} per edit), *of known* = of those the model answered right, still right "
           "(– where not measured); undo = logits bitwise equal after undoing. Goal: ≥ "
           f"{EDIT_FLIP_GOAL:.0%} flips on held-out phrasings with ≥ {EDIT_LOCALITY_GOAL:.0%} locality.", "",
           "| phrasing | dense model knows | STEM at | knows | edited facts | flips | p(target) before → after | locality "
           "| of known | undo |",
           "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for split, rows in pl.items():
        dk = data["dense_known"][split]
        for label in [k for k in rows if not k.isdigit()]:
            r = rows[label]
            out.append(_edit_row(split, f"{dk['first']}/{dk['asked']}", f"{label} ({len(r['layers'])} layers)", r))
    for m in data.get("midtrained", []):
        for split in ("train", "heldout_template"):
            r = m[split]
            out.append(_edit_row(split, "", f"mid-trained `{Path(m['checkpoint']).parent.parent.name}` "
                                 f"({len(m['layers'])} layers)", r))
    singles = {int(k): v for k, v in pl.get("heldout_template", {}).items() if k.isdigit()}
    if len(singles) >= 3:
        plot = plot_layers(singles, {int(k): v for k, v in pl.get("train", {}).items() if k.isdigit()})
        best = sorted(singles, key=lambda i: -(singles[i]["prob_shift"] or 0))[:5]
        out += ["", "Per-layer attribution (STEM in one layer only, that layer's rows swapped): the layers whose rows "
                "move the most probability to the other country's capital (held-out phrasings): " +
                ", ".join(f"{i} ({singles[i]['prob_shift']:+.3f})" for i in best) + ".",
                "", f"![per-layer attribution]({Path('..') / plot.relative_to(ROOT)})" if plot else ""]
    return out


# bench_edit_real's settings that a result records, with their defaults (older results lack the newer keys)
EDIT_DEFAULTS = {"calib_unseen": "pooled", "calib_tokens": 131072, "strategy": "auto", "align": "left",
                 "protect_shared": False}


def changed(data: dict) -> dict:
    """The bench_edit_real settings of a result that differ from the defaults."""
    return {k: data.get(k, d) for k, d in EDIT_DEFAULTS.items() if data.get(k, d) != d}


def edit_settings(data: dict) -> list[str]:
    """Those changes in words (the calibration-token count left out): ``["unseen ids regress", ...]``."""
    c = changed(data)
    return [part for part in (f"unseen ids {c['calib_unseen']}" if "calib_unseen" in c else "",
                              f"strategy {data.get('strategy', 'auto')} ({data.get('align', 'left')})"
                              if {"strategy", "align"} & set(c) else "",
                              "shared subwords kept" if c.get("protect_shared") else "") if part]


def _edit_row(split: str, dense_knows: str, placed: str, r: dict) -> str:
    """One row of the edit table: a placement's (or a mid-trained model's) result on one phrasing split."""
    return (f"| {split} | {dense_knows} | {placed} | {r['known_facts']}/{r['probes']} | {r['known']} | "
            f"{pct(r['success'])} | {num(r['prob_target_before'])} → {num(r['prob_target_after'])} | "
            f"{pct(r['locality_top1'])} | {pct(r.get('locality_known'))} | {pct(r['reversible'])} |")


def plot_layers(held: dict, train: dict) -> Path | None:
    plt = pyplot_or_none()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(9, 3.4))
    for name, d in (("held-out phrasings", held), ("training phrasing", train)):
        if d:
            layers = sorted(d)
            ax.plot(layers, [d[i]["prob_shift"] or 0 for i in layers], marker="o", label=name)
    ax.set(xlabel="layer whose rows are swapped (STEM in that layer only)", ylabel="Δ p(other country's capital)",
           title="where SmolLM2-135M's capital facts sit in the calibrated rows")
    ax.axhline(0, color="k", lw=0.8)
    ax.legend(fontsize=8)
    return save(fig, PLOTS / "edit_attribution.png", dpi=110)


def pyplot_or_none():
    """matplotlib's pyplot, or None where it is not installed (the tables are written without plots)."""
    try:
        from stemlm.runtime.plotting import pyplot
        return pyplot()
    except ImportError:
        return None


def pct(x) -> str:
    """A share as a percentage, ``–`` for None."""
    return "–" if x is None else f"{x:.1%}"


def num(x) -> str:
    """A number to three decimals, ``–`` for None."""
    return "–" if x is None else f"{x:.3f}"
