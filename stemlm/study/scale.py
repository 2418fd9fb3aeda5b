"""The scale a claim was measured at, the paper's, and what would settle an open verdict.

A verdict is only as wide as the run behind it: ``measured`` reads the model size, tokens and
seeds from the runs of the stage a claim draws on; ``PAPER`` holds the scale the paper reports the
claim at (``paper.py``). Where the measured tokens are ``FAR`` or more times below the paper's,
a verdict that is not ``holds`` reads "not recovered within N tokens (paper: M; R× more)", and a
contradiction at that distance is not called one: it says what was not reached, not that the
paper is wrong. ``SETTLE`` says, per claim, what would settle it.
"""

from __future__ import annotations

from .paper import ENGRAM_TOKENS, TABLE3_TOKENS

FAR = 100  # a run this many times fewer tokens than the paper's is "far below" its scale

# claim -> (the stage whose runs measure it, the paper's tokens, the paper's scale in words)
PAPER = {
    "roi": ("compare", TABLE3_TOKENS, "350M, 100B tokens (Table 3)"),
    "dynamics": ("compare", TABLE3_TOKENS, "350M, 100B tokens (Table 3)"),
    "knowledge": ("compare", TABLE3_TOKENS, "350M, 100B tokens (Table 3)"),
    "stability": ("compare", TABLE3_TOKENS, "350M, 100B tokens (Table 3; curves Fig. 3a)"),
    "ablation": ("compare", TABLE3_TOKENS, "350M, 100B tokens (Table 3)"),
    "ngram": ("compare", ENGRAM_TOKENS, "Engram-27B, 262B tokens (Engram paper §4.1)"),
    "long_context": ("context", None, "the NIAH model's tokens are not quoted in the sources of paper.py"),
    "midtrain": ("midtrain", None, "a 1B model pretrained on 1T tokens (official README); Table 4's "
                                               "mid-training tokens are not quoted in the sources of paper.py"),
}

SETTLE = {
    "roi": "the same comparison on ≥ 10× the tokens (the wide corpus and studies/gpu.yaml: d384, 3 seeds) to see "
           "whether the lead lasts past one epoch of ~1 token per parameter",
    "dynamics": "≥ 10× the tokens at 3 seeds (the wide corpus, studies/gpu.yaml), judged side by side with d128",
    "knowledge": "more seeds (below) and a larger model that reads each fact more often",
    "stability": "≥ 6 paired spikes between STEM-1/3 and Hash-MoE-1/3: longer runs at and above the paper's lr, "
                 "several seeds, each paired with dense on the same batches",
    "long_context": "context models that retrieve at all (neither arm does at d128 after 80 steps of extension, while "
                    "the positive control shows the probe sees retrieval where a model has it): a longer extension at "
                    "a larger size, then more seeds",
    "midtrain": "≥ 2 seeds at the study's budget (3 seeds on one GPU: docs/insertion.md), and the paper's mid-training "
                "tokens, which no offline corpus here holds in SmolLM2's vocabulary",
    "ablation": "more seeds for the inconclusive differences (below)",
    "ngram": "more seeds for an inconclusive difference, and ≥ 10× the text (the wide corpus), where more distinct "
             "n-grams compete for the same slots",
}


WIDE_TOKENS = 10e6  # a run that read this many tokens already had the wide corpus (studies/gpu.yaml)
SETTLE_WIDE = {  # what settles the scale claims once they were measured on the wide corpus
    "roi": "all 3 seeds of the wide-corpus comparison (studies/gpu.yaml), then ≥ 10× its tokens, which needs more text "
           "than the offline corpora hold",
    "dynamics": "all 3 seeds of the wide-corpus comparison (studies/gpu.yaml), judged beside d128; then ≥ 10× its tokens",
}


def settle_text(key: str, scale: dict | None) -> str:
    """``SETTLE[key]``, or for a scale claim already measured on the wide corpus what lies beyond it."""
    if key in SETTLE_WIDE and scale is not None and scale["tokens"] >= WIDE_TOKENS:
        return SETTLE_WIDE[key]
    return SETTLE[key]


def tokens_text(n: float) -> str:
    """``2361344`` → ``2.36M``; ``1e11`` → ``100B``."""
    for div, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if n >= div:
            return f"{n / div:.3g}{unit}"
    return f"{n:.0f}"


def measured(runs: list[dict], key: str) -> dict | None:
    """``{"sizes", "tokens", "seeds", "text"}`` of the finished runs of the claim's stage (None without any)."""
    stage = PAPER[key][0]
    rs = [r for r in runs if r["stage"] == stage and r["status"] == "finished"]
    tokens = [r["metrics"].get("tokens_seen") for r in rs if r["metrics"].get("tokens_seen")]
    if not rs or not tokens:
        return None
    sizes = sorted({r["labels"].get("size") or r["labels"].get("source") or "-" for r in rs})
    per_variant: dict[str, set] = {}
    for r in rs:
        per_variant.setdefault(r["labels"].get("variant", "-"), set()).add(r["labels"].get("seed", 0))
    fewest, most = min(map(len, per_variant.values())), max(map(len, per_variant.values()))
    seeds_text = (f"{most} seed{'s' if most > 1 else ''}" if fewest == most
                  else f"{fewest}–{most} seeds per variant")  # a comparison is as strong as its fewest pairs
    t = max(tokens)
    return {"sizes": sizes, "tokens": t, "seeds": fewest,
            "text": f"{', '.join(sizes)}, {tokens_text(t)} tokens per run, {seeds_text}"}


def reading(key: str, verdict: str, scale: dict | None) -> tuple[str, str]:
    """``(verdict, reading)``: a contradiction far below the paper's tokens becomes ``not recovered``; the
    reading names the tokens measured against the paper's, with the ratio."""
    if scale is None:
        return verdict, ""
    paper_tokens, paper_text = PAPER[key][1], PAPER[key][2]
    n = tokens_text(scale["tokens"])
    if paper_tokens is None:  # the paper's tokens for this claim are not quoted: no ratio
        word = "measured at" if verdict in ("holds", "probe blind", "untestable") else f"not recovered within {n} tokens:"
        return verdict, f"{word} {scale['text']} (paper: {paper_text})"
    ratio = paper_tokens / scale["tokens"]
    if ratio < FAR or verdict in ("probe blind", "untestable"):
        return verdict, f"measured at {scale['text']} (paper: {paper_text}; {ratio:,.0f}× more tokens)"
    if verdict == "contradicted":
        verdict = "not recovered"
    word = "holds at" if verdict == "holds" else "not recovered within"
    return verdict, f"{word} {n} tokens ({scale['text']}; paper: {paper_text}, {ratio:,.0f}× more tokens)"
