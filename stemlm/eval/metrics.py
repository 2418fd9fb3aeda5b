"""Scores of answered requests: accuracies, bits per byte, exact match, and their standard errors.

The conventions are lm-evaluation-harness's: ``acc`` picks the choice of highest summed
log-probability; ``acc_norm`` divides each by the choice's length in characters (the choice text,
i.e. the continuation without the one leading space that separates it from the context);
standard errors of a mean are the sample standard deviation (ddof=1) over ``sqrt(n)``. Ties go to
the first choice. ``acc_uncond`` is OLMo-eval's score: the conditional log-probability minus the
log-probability of the same continuation after the bare context ``"Answer:"``.
"""

from __future__ import annotations

import math
import re
import string
from collections.abc import Sequence

import numpy as np


def mean_stderr(values: Sequence[float]) -> tuple[float, float]:
    """``(mean, sample std / sqrt(n))``; the error of fewer than two values is NaN."""
    arr = np.asarray(values, dtype=np.float64)
    if arr.size == 0:
        return math.nan, math.nan
    err = float(arr.std(ddof=1) / math.sqrt(arr.size)) if arr.size > 1 else math.nan
    return float(arr.mean()), err


def choice_length(continuation: str) -> int:
    """Characters of a choice as the harness counts them for ``acc_norm`` (no leading separator)."""
    return len(continuation[1:] if continuation.startswith(" ") else continuation)


def pick(scores: Sequence[float]) -> int:
    """Index of the highest score (the first on ties)."""
    return int(np.argmax(np.asarray(scores, dtype=np.float64)))


def mc_correct(logprobs: Sequence[float], continuations: Sequence[str], gold: int,
               uncond: Sequence[float] | None = None) -> dict[str, float]:
    """Per-item 0/1 outcomes: ``acc``, ``acc_norm`` and, given the unconditional log-probs, ``acc_uncond``."""
    out = {"acc": float(pick(logprobs) == gold),
           "acc_norm": float(pick([lp / max(choice_length(c), 1) for lp, c in zip(logprobs, continuations)]) == gold)}
    if uncond is not None:
        out["acc_uncond"] = float(pick([lp - u for lp, u in zip(logprobs, uncond)]) == gold)
    return out


def summarize(outcomes: Sequence[dict[str, float]]) -> dict[str, float]:
    """Mean and ``<key>_stderr`` of every per-item outcome key, with ``n`` (items that carry the key)."""
    out: dict[str, float] = {}
    for key in sorted({k for o in outcomes for k in o}):
        values = [o[key] for o in outcomes if key in o]
        out[key], out[f"{key}_stderr"] = mean_stderr(values)
        if len(values) != len(outcomes):
            out[f"n_{key}"] = len(values)
    out["n"] = len(outcomes)
    return out


def item_outcomes(ids: Sequence, outcomes: Sequence[dict[str, float]], metric: str) -> dict:
    """``{"ids": [...], "<metric>": [0/1, ...]}``: each item's outcome of the primary metric, in item order, kept
    in a result so that two models scored on the same items can be compared item by item (``paired``)."""
    return {"ids": [str(i) for i in ids], metric: [int(o[metric]) for o in outcomes]}


def paired_difference(a: Sequence[float], b: Sequence[float], z: float = 1.96) -> dict[str, float]:
    """Mean of ``a − b`` over paired items, its standard error (sample std of the differences / sqrt(n)) and the
    ``z`` interval: the same items in both, so what both models get right or wrong alike drops out (an
    unpaired difference of two 500-item accuracies near 0.5 has an error of ~0.032; a paired one of two
    similar models is often half that)."""
    d = np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)
    if d.size == 0:
        raise ValueError("a paired difference needs at least one item")
    mean, err = mean_stderr(d)
    return {"diff": mean, "stderr": err, "low": mean - z * err, "high": mean + z * err, "n": int(d.size),
            "a_only": int((d > 0).sum()), "b_only": int((d < 0).sum())}


def bits_per_byte(logprobs: Sequence[float], texts: Sequence[str]) -> tuple[float, float]:
    """``(bpb, stderr)`` over a corpus: ``-sum(logprob) / (ln 2 * sum(UTF-8 bytes))``.

    The error is the ratio estimator's (delta method): ``sqrt(sum((l_i - r b_i)^2) / (n (n-1))) / mean(b)``
    with ``l_i`` bits and ``b_i`` bytes of item ``i``.
    """
    bits = -np.asarray(logprobs, dtype=np.float64) / math.log(2)
    nbytes = np.asarray([len(t.encode("utf-8")) for t in texts], dtype=np.float64)
    if bits.size == 0 or nbytes.sum() == 0:
        return math.nan, math.nan
    ratio = float(bits.sum() / nbytes.sum())
    n = bits.size
    if n < 2:
        return ratio, math.nan
    err = math.sqrt(float(((bits - ratio * nbytes) ** 2).sum()) / (n * (n - 1))) / float(nbytes.mean())
    return ratio, err


_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = set(string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD's normalisation: lowercase, drop punctuation and the articles a/an/the, collapse whitespace."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCT)
    return " ".join(_ARTICLES.sub(" ", text).split())


def exact_match(prediction: str, answers: Sequence[str]) -> float:
    """1.0 when the normalised prediction equals any normalised answer, else 0.0."""
    pred = normalize_answer(prediction)
    return float(any(pred == normalize_answer(a) for a in answers))
