"""The paper's claims held against a study's results: one row per claim, one verdict rule for all.

Each row: the claim, the paper's own numbers with their table or section (``paper.QUOTES``), what
the study measured (each comparison as ``difference [95 % interval], MDE``), the verdict and its
rule. Verdicts are ``holds`` / ``contradicted`` / ``inconclusive`` by ``stats.verdict`` on a
difference whose noise comes from the seeds (each seed fixes init and data order; runs of the
same seed are paired). A comparison without a noise estimate, or whose probe failed its positive
control, is inconclusive. The report and the README's claims table are both drawn from
``claim_rows``; the comparisons themselves live in ``evidence``.
"""

from __future__ import annotations

from .evidence import (ablation_parts, dynamics_parts, knowledge_parts, midtrain_parts, needle_parts, roi_parts,
                       stability_parts)
from .paper import QUOTES
from .stats import RULE, combine

RULES = {
    "roi": "per placement and size: the loss ROI minus 1, per seed against dense of the same seed; predicted > 0",
    "dynamics": "per placement: slope of the gap to dense against log₂ tokens over the second half of training, "
                "per seed; predicted < 0 (the lead grows)",
    "knowledge": "slope, per seed, of the knowledge probe (seen − unseen log-prob contrast, training templates) "
                 "against the fraction of layers that are STEM (dense 0 … full); predicted > 0; inconclusive when the probe's "
                 "positive control fails",
    "stability": "loss spikes (robust detector, after warm-up) of STEM-1/3 against Hash-MoE-1/3 over the sweep's runs at "
                 "the paper's lr and above, exact sign test (5 %); predicted: fewer for STEM",
    "long_context": "needle probe gain (key log-prob with − without the needle), STEM-1/3 − dense, per seed; predicted > 0; "
                    "inconclusive when the probe's positive control fails",
    "midtrain": "final validation loss, each STEM arm − the dense arm continued on the same tokens, per seed (with one "
                "seed: per validation batch, which leaves out seed noise); predicted < 0",
    "ablation": "final validation loss, STEM-1/3 − the gate ablation, per seed; predicted < 0",
}
BUILDERS = {"roi": roi_parts, "dynamics": dynamics_parts, "knowledge": knowledge_parts, "stability": stability_parts,
            "long_context": needle_parts, "midtrain": midtrain_parts, "ablation": ablation_parts}


def claim_rows(runs: list[dict], evals: dict, timing: dict | None = None, settings: dict | None = None) -> list[dict]:
    """``[{claim, paper, measured, verdict, rule, parts}]`` for every claim the results speak to.

    ``parts``: the comparisons behind the verdict, ``{"label", "text", "verdict", "difference"}``."""
    rows = []
    for key, build in BUILDERS.items():
        parts, notes = build(runs, evals, settings or {})
        if not parts and not notes:
            continue
        quote = QUOTES[key]
        verdict = combine([p["verdict"] for p in parts]) if parts else "inconclusive"
        measured = "; ".join([f"{p['label']}: {p['text']} → {p['verdict']}" for p in parts] + notes)
        rows.append({"key": key, "claim": quote.claim, "paper": quote.cell(), "measured": measured,
                     "verdict": verdict, "rule": f"{RULES[key]}. {RULE}", "parts": parts, "notes": notes})
    return rows
