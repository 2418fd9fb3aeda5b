"""The paper's claims held against a study's results: one row per claim, one verdict rule for all.

Each row: the claim, the paper's own numbers with their table or section (``paper.QUOTES``), what
the study measured (each comparison as ``difference [95 % interval], MDE``), the verdict and its
rule, the scale it was measured at and what would settle it (``scale``). Verdicts are ``holds`` /
``contradicted`` / ``inconclusive`` by ``stats.verdict`` on a difference whose noise comes from the
seeds (each seed fixes init and data order; runs of the same seed are paired): one seed is always
inconclusive. The comparisons a claim combines (placements, arms) are Holm-corrected together
(``stats.holm``), and the corrected interval is printed with each. Two more verdicts say why nothing
was judged: ``probe blind`` (the probe failed its positive control) and ``untestable`` (no outcome
of the test could be significant at this scale). A contradiction ≥ ``scale.FAR`` times below the
paper's tokens reads ``not recovered`` within the tokens measured. The report and the README's
claims table are both drawn from ``claim_rows``; the comparisons themselves live in ``evidence``.
"""

from __future__ import annotations

from .evidence import (BLIND, ablation_parts, dynamics_parts, knowledge_parts, midtrain_parts, needle_parts,
                       ngram_parts, roi_parts, stability_parts)
from .paper import CAVEATS, QUOTES
from .scale import measured, reading, settle_text
from .stats import RULE, Difference, combine, holm, interval, seeds_needed

RULES = {
    "roi": "per placement and size: the loss ROI minus 1, per seed against dense of the same seed; predicted > 0",
    "dynamics": "per placement: slope of the gap to dense against log₂ tokens over the second half of training, "
                "per seed; predicted < 0 (the lead grows)",
    "knowledge": "slope, per seed, of the knowledge probe (seen − unseen log-prob contrast, training templates) "
                 "against the fraction of layers that are STEM (dense 0 … full); predicted > 0; probe blind when the "
                 "probe's positive control fails",
    "stability": "loss spikes of every comparison run against dense's run of the same seed (same batches: shared "
                 "data bumps cancel), after the paper's warm-up ratio, STEM-1/3 against Hash-MoE-1/3, exact sign test "
                 "(5 %); predicted: fewer for STEM; untestable when no split of the spikes found could be significant",
    "long_context": "needle probe margin (the key's log-prob − a decoy number's of the same shape, both twice in the "
                    "context: retrieval, not repetition), STEM-1/3 − dense, per seed; predicted > 0; probe blind unless "
                    "the positive control retrieves ≥ 50 % of keys greedily",
    "midtrain": "final validation loss, each STEM arm − the dense arm continued on the same tokens, per seed (one seed: "
                "inconclusive; its validation batches are not replicates); predicted < 0",
    "ablation": "final validation loss per seed: STEM-1/3 − gate < 0, gate − dense > 0 (§4.4.2), STEM† − STEM-1/3 > 0, "
                "Hash-MoE − STEM-1/3 > 0",
    "ngram": "final validation loss per seed: n-gram-1/3 − STEM-1/3 < 0 at equal table bytes (each at its own best lr); "
             "STEM-1/3 with an Engram-style memory − STEM-1/3 < 0",
}
BUILDERS = {"roi": roi_parts, "dynamics": dynamics_parts, "knowledge": knowledge_parts, "stability": stability_parts,
            "long_context": needle_parts, "midtrain": midtrain_parts, "ablation": ablation_parts, "ngram": ngram_parts}


def correct(parts: list[dict]) -> list[dict]:
    """Holm's correction over a claim's judged parts (``stats.holm``): each part gets ``raw_verdict``,
    ``holm`` ({p, level, rank, m}) and its verdict at the corrected level, and its text the corrected
    interval. Parts that are probe blind or untestable stay so and are not counted."""
    judged = [p for p in parts if p["verdict"] in ("holds", "contradicted", "inconclusive")]
    if len(judged) < 2:
        return parts
    for p, h in zip(judged, holm([(p.get("p"), p["verdict"]) for p in judged])):
        p["raw_verdict"], p["verdict"] = p["verdict"], h["verdict"]
        p["holm"] = {k: h[k] for k in ("p", "level", "rank", "m")}
        d = p["difference"]
        if h["p"] is None or d.get("se") is None or "mean" not in d:
            continue  # no noise estimate: inconclusive whatever the level
        lo, hi = interval(Difference(**{**d, "ci": None}), h["level"])
        stopped = h["verdict"] == "inconclusive" and h["p"] < 1 - h["level"]
        p["text"] += (f"; Holm {h['rank']} of {h['m']}, p = {h['p']:.3g}: {100 * h['level']:.1f} % interval "
                      f"[{lo:+.3f}, {hi:+.3f}]{p.get('unit', '')}"
                      + (" (not judged: a comparison of smaller p was not significant at its level)" if stopped else ""))
    return parts


def claim_verdict(parts: list[dict]) -> str:
    """One verdict for a claim's (corrected) parts: probe blind or untestable when every part is, else
    ``stats.combine`` over the judged ones (a blind or untestable part counts as inconclusive)."""
    vs = [p["verdict"] for p in parts]
    if not vs:
        return "inconclusive"
    for word in (BLIND, "untestable"):
        if all(v == word for v in vs):
            return word
    return combine([v if v in ("holds", "contradicted") else "inconclusive" for v in vs])


def _settle(key: str, parts: list[dict], scale: dict | None) -> str:
    need = [seeds_needed(Difference(**{**p["difference"], "ci": None}))
            for p in parts if p["verdict"] in ("inconclusive", BLIND) and p["difference"].get("kind") == "paired"]
    need = [n for n in need if n is not None]
    seeds = (f"; ~{max(need) if max(need) <= 100 else '> 100'} seeds to detect the open difference that needs the "
             "most, at the spread measured") if need else ""
    return settle_text(key, scale) + seeds


def verdict_cell(row: dict) -> str:
    """``**verdict** — reading; to settle: ...`` for a table cell."""
    return f"**{row['verdict']}**" + (f" — {row['reading']}" if row["reading"] else "") + f". To settle: {row['settle']}"


def claim_rows(runs: list[dict], evals: dict, timing: dict | None = None, settings: dict | None = None) -> list[dict]:
    """``[{claim, paper, measured, verdict, reading, scale, settle, rule, parts, notes}]`` for every claim the
    results speak to.

    ``parts``: the comparisons behind the verdict, ``{"label", "text", "verdict", "difference", "p"}`` (with
    ``raw_verdict`` and ``holm`` where several are corrected together)."""
    rows = []
    for key, build in BUILDERS.items():
        parts, notes = build(runs, evals, settings or {})
        if not parts and not notes:
            continue
        parts = correct(parts)
        notes = notes + ([f"on the paper: {CAVEATS[key]}"] if key in CAVEATS else [])
        quote = QUOTES[key]
        scale = measured(runs, key)
        verdict, read = reading(key, claim_verdict(parts), scale)
        if len({p["verdict"] for p in parts}) > 1:
            counts = {v: sum(p["verdict"] == v for p in parts) for v in dict.fromkeys(p["verdict"] for p in parts)}
            read = f"{len(parts)} comparisons: " + ", ".join(f"{n} {v}" for v, n in counts.items()) + f"; {read}"
        measured_text = "; ".join([f"{p['label']}: {p['text']} → {p['verdict']}" for p in parts] + notes)
        rows.append({"key": key, "claim": quote.claim, "paper": quote.cell(), "measured": measured_text,
                     "verdict": verdict, "reading": read, "scale": scale, "settle": _settle(key, parts, scale),
                     "rule": f"{RULES[key]}. {RULE}", "parts": parts, "notes": notes})
    return rows
