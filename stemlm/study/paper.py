"""What the STEM paper (arXiv 2601.10639) and its official README publish: the one reviewed place.

Every number the study's report, claims table and README quote comes from here, each with the table,
figure or section it is printed in. Sources:

* the paper: Table 2 (training hyper-parameters), Table 3 (350M placements and ablations, average
  accuracy and GFLOPs per token), Table 4 (mid-training), the introduction and Fig. 1b (NIAH),
  Fig. 3a (loss curves);
* the official README (github.com/Infini-AI-Lab/STEM): the 350M and 1B pretraining tables and the
  mid-training table, with per-task accuracies.

Nothing here is recalled from memory; a number that neither source prints is not quoted. Four phrases
of the paper's text (``TEXT``: §4.1, §4.3, §4.4.2) are quoted as an outside audit of the study
(issue #34) quoted them; they mark where the paper is read with care (``CAVEATS``). Numbers
that the report computes with are kept as data (``TABLE3``, ``TABLE2``), and a test checks that
the published ROIs follow from them.
"""

from __future__ import annotations

from dataclasses import dataclass

README = "official README (github.com/Infini-AI-Lab/STEM)"

TABLE3_TOKENS = 100e9  # Table 3's 350M models: "100B tokens"
# Table 3, 350M, 100B tokens: average accuracy over the eight tasks and GFLOPs per token.
TABLE3 = {
    "dense": {"avg_acc": 49.72, "gflops": 0.74},
    "stem-1/3": {"avg_acc": 50.90, "gflops": 0.70, "roi": 1.08},
    "stem-1/2": {"avg_acc": 54.20, "gflops": 0.67, "roi": 1.20},
    "stem-full": {"avg_acc": 53.43, "gflops": 0.60, "roi": 1.33},
}
# Table 3, ablations at 350M: average accuracy and ROI (GFLOPs not quoted here).
TABLE3_ABLATIONS = {
    "stem_gate-1/3": {"label": "gate-proj", "avg_acc": 49.10, "roi": 1.04},
    "stem_dagger-1/3": {"label": "STEM†", "avg_acc": 50.60, "roi": 1.02},
    "hash_moe-1/3": {"label": "Hash-MoE (1.22B total)", "avg_acc": 50.58, "roi": 1.02},
}
# Table 2: the 350M training setting, one lr and one weight decay for every parameter.
TABLE2 = {"lr": 2e-3, "weight_decay": 0.1, "betas": (0.9, 0.95), "warmup_ratio": 0.01, "min_lr_ratio": 0.1}
# ARC-Challenge and OBQA of the 350M placements (dense, STEM 1/3, 1/2, all layers): printed in the paper's
# Table 3, and in the official README's "350M model with 100B training tokens" table, where the ARC values
# stand under the column headed ``arc_easy`` (the README's two ARC headers are swapped).
README_350M = {"arc_challenge": (30.55, 32.68, 40.00, 39.61), "obqa": (34.80, 33.00, 46.68, 44.53),
               "average": (49.72, 50.90, 54.20, 53.43)}
README_1B = {"dense": 55.82, "stem": 56.63}  # "1B models with 1T training tokens", average accuracy
README_MIDTRAIN = {"average": (57.50, 58.49), "gsm8k": (44.2, 46.4), "mmlu": (29.92, 32.38)}  # dense, STEM


# Phrases of the paper's text, as quoted by the audit of issue #34 (section: words).
TEXT = {
    "warmup": ("§4.1", "10 % warmup"),
    "midtrain": ("§4.3", "continues to outperform"),
    "gate": ("§4.4.2", "underperforms even the dense baseline"),
}
CAVEATS = {
    "stability": f"the paper states its warm-up twice: Table 2 gives a ratio of {TABLE2['warmup_ratio']:g}, "
                 f"{TEXT['warmup'][0]} says \"{TEXT['warmup'][1]}\"; the study uses Table 2's",
    "midtrain": f"{TEXT['midtrain'][0]} says STEM \"{TEXT['midtrain'][1]}\" at mid-training, which reads like a STEM "
                "model pretrained as STEM and mid-trained further, not a dense model with STEM inserted: Table 4 may "
                "not be an insertion result at all",
    "dynamics": "Fig. 3a is a crossover from behind (STEM starts behind dense and pulls ahead); at d128 STEM leads "
                "from the first evaluation, so what is tested here is only whether the lead grows",
    "ablation": f"{TEXT['gate'][0]}: the gate ablation \"{TEXT['gate'][1]}\"; Table 3's averages agree (gate-proj "
                f"{TABLE3_ABLATIONS['stem_gate-1/3']['avg_acc']:.2f} vs dense {TABLE3['dense']['avg_acc']:.2f})",
}


@dataclass(frozen=True)
class Quote:
    """A claim of the paper in its own numbers, and where they are printed."""

    claim: str
    text: str
    source: str

    def cell(self) -> str:
        """``text (source)`` for a table cell."""
        return f"{self.text} ({self.source})"


def _placements(key: str) -> str:
    return " / ".join(f"{TABLE3[p][key]:.2f}" for p in ("stem-1/3", "stem-1/2", "stem-full"))


# Engram (Cheng et al., "Conditional Memory via Scalable Lookup: A New Axis of Sparsity for Large Language Models",
# DeepSeek-AI, January 2026, arXiv 2601.07372; github.com/deepseek-ai/Engram): the claim stemlm's n-gram kinds test.
ENGRAM_TOKENS = 262e9  # §4.1: "All models are pre-trained on 262 billion tokens"
ENGRAM_TEXT = {
    "allocation": ("§3.1", "Reallocating roughly 20%–25% of the sparse parameter budget to Engram yields the best "
                           "performance."),
    "abstract": ("abstract", "we scale Engram to 27B parameters, achieving superior performance over a strictly "
                             "iso-parameter and iso-FLOPs MoE baseline"),
}

QUOTES: dict[str, Quote] = {
    "roi": Quote(
        "(a) STEM beats dense at lower per-token FLOPs (ROI > 1 at 1/3, 1/2, full)",
        f"350M, 100B tokens: average accuracy {TABLE3['dense']['avg_acc']:.2f} dense vs {_placements('avg_acc')} "
        f"(STEM in 1/3, 1/2, all layers) at {TABLE3['dense']['gflops']:.2f} vs {_placements('gflops')} GFLOPs/token: "
        f"ROI {_placements('roi').replace(' / ', '× / ')}×; 1B, 1T tokens: average {README_1B['stem']:.2f} vs "
        f"{README_1B['dense']:.2f}",
        f"Table 3; 1B: {README}"),
    "dynamics": Quote(
        "(a′) STEM's lead over dense grows with training",
        "training-loss curves in which STEM pulls ahead of dense late in training (qualitative)", "Fig. 3a"),
    "knowledge": Quote(
        "(b) more STEM layers, more knowledge",
        "350M: ARC-Challenge " + " → ".join(f"{x:.2f}" for x in README_350M["arc_challenge"]) + ", OBQA "
        + " → ".join(f"{x:.2f}" for x in README_350M["obqa"]) + " (dense, 1/3, 1/2, all layers)",
        f"Table 3; also the {README} 350M table, whose ARC headers are swapped"),
    "stability": Quote(
        "(c) STEM trains stably where Hash-layer MoE spikes",
        f"loss curves: Hash-layer MoE shows loss spikes, STEM and dense stay smooth (qualitative); trained at peak lr "
        f"{TABLE2['lr']:g} (350M), weight decay {TABLE2['weight_decay']:g}, β {TABLE2['betas'][0]:g}/"
        f"{TABLE2['betas'][1]:g}, warmup ratio {TABLE2['warmup_ratio']:g}, min lr {TABLE2['min_lr_ratio']:g}× peak",
        "Fig. 3a; setting: Table 2"),
    "long_context": Quote(
        "(d) STEM helps long context after context extension",
        "the needle-in-a-haystack gap between STEM and dense \"increases from 8.4% to 13%\"",
        "introduction, Fig. 1b"),
    "midtrain": Quote(
        "(e) STEM inserted into a pretrained dense model at mid-training",
        f"average accuracy {README_MIDTRAIN['average'][0]:.2f} → {README_MIDTRAIN['average'][1]:.2f}, GSM8K "
        f"{README_MIDTRAIN['gsm8k'][0]:.1f} → {README_MIDTRAIN['gsm8k'][1]:.1f}, MMLU {README_MIDTRAIN['mmlu'][0]:.2f} → "
        f"{README_MIDTRAIN['mmlu'][1]:.2f} (dense continued → STEM)",
        f"Table 4; {README}, mid-training table"),
    "ablation": Quote(
        "ablations: the table replaces the up-projection, not the gate; gate-proj below dense; STEM† and Hash-MoE "
        "below STEM",
        "350M average accuracy (ROI): " + ", ".join(f"{a['label']} {a['avg_acc']:.2f} ({a['roi']:.2f}×)"
                                                    for a in TABLE3_ABLATIONS.values())
        + f" vs STEM-1/3 {TABLE3['stem-1/3']['avg_acc']:.2f} ({TABLE3['stem-1/3']['roi']:.2f}×) and dense "
        f"{TABLE3['dense']['avg_acc']:.2f}; gate-proj \"{TEXT['gate'][1]}\"",
        f"Table 3; {TEXT['gate'][0]}"),
    "ngram": Quote(
        "n-gram keys beat token keys at equal table bytes (Engram's claim, carried to STEM's tables)",
        f"\"{ENGRAM_TEXT['allocation'][1]}\" ({ENGRAM_TEXT['allocation'][0]}); \"{ENGRAM_TEXT['abstract'][1]}\" "
        f"({ENGRAM_TEXT['abstract'][0]}) — against MoE experts, not STEM tables",
        "Engram paper, arXiv 2601.07372"),
}
