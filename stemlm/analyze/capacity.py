"""Test-time capacity (paper §3.2): distinct STEM parameters a context activates.

A STEM layer reads one table row (``d_ff`` values) per *distinct* token of the context, so a
context of ``n`` tokens with ``U(n)`` unique tokens activates ``|S| · d_ff · U(n)`` table
parameters (``|S|`` = number of table layers), growing with context length, whereas the dense
up-projections it replaced always hold ``|S| · d_model · d_ff``. Unique tokens follow Heaps' law
``U = K · n^β``; ``fit_heaps`` estimates ``K, β`` by least squares on ``log U = log K + β log n``.

``U(n)`` is the mean number of unique ids over windows of ``n`` consecutive tokens of a real
token stream (documents back to back, as in training).

An n-gram layer (``stemlm.ffn.ngram``) reads rows by *keys*, not tokens: ``K`` per position (the
token's row and the hashed slots of its bigrams, trigrams, ...). Such a layer activates ``d_ff`` values
per distinct key of the context, ``D(n)`` = the mean number of distinct values of the model's n-gram
keys over the same windows (each window keyed as a sequence of its own), ``D(n) >= U(n)`` because the
token rows are keys too. ``capacity(..., keys=..., n_key_layers=...)`` adds ``D(n)`` and its Heaps fit,
and counts the activated parameters of n-gram layers from keys and of token layers from tokens.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from ..runtime.plotting import pyplot, save
from .text import windows


@dataclass
class HeapsFit:
    """``U = K · n^β`` and the fit's coefficient of determination in log space."""

    K: float
    beta: float
    r2: float

    def predict(self, n) -> np.ndarray:
        return self.K * np.asarray(n, dtype=np.float64) ** self.beta


def fit_heaps(n: np.ndarray, unique: np.ndarray) -> HeapsFit:
    """Least-squares fit of ``log U = log K + β log n``."""
    n, unique = np.asarray(n, dtype=np.float64), np.asarray(unique, dtype=np.float64)
    if len(n) != len(unique) or len(n) < 2:
        raise ValueError("need at least two (n, U) points of equal count to fit Heaps' law")
    if (n <= 0).any() or (unique <= 0).any():
        raise ValueError("Heaps' law fit needs positive n and U")
    x, y = np.log(n), np.log(unique)
    beta, log_k = np.polyfit(x, y, 1)
    resid = y - (log_k + beta * x)
    total = ((y - y.mean()) ** 2).sum()
    r2 = 1.0 - (resid ** 2).sum() / total if total > 0 else 1.0
    return HeapsFit(float(np.exp(log_k)), float(beta), float(r2))


def context_lengths(max_len: int, min_len: int = 8) -> list[int]:
    """Powers of two from ``min_len`` up to ``max_len`` (``max_len`` itself included)."""
    out, n = [], min_len
    while n < max_len:
        out.append(n)
        n *= 2
    return out + [max_len]


def unique_curve(stream: np.ndarray, lengths: list[int], n_windows: int = 32, seed: int = 0) -> np.ndarray:
    """Mean number of unique ids in windows of each length."""
    return np.array([np.mean([len(np.unique(w)) for w in windows(stream, n, n_windows, seed)]) for n in lengths])


def distinct_keys_curve(stream: np.ndarray, lengths: list[int], keys, n_windows: int = 32, seed: int = 0) -> np.ndarray:
    """Mean number of distinct n-gram keys (table rows read) in windows of each length.

    ``keys`` is the model's n-gram key function (``model.ngram_keys``, ``analyze.ngram.ngram_key_function``):
    ids ``(B, T)`` -> keys ``(B, T, K)``; every window is keyed as a sequence of its own (its first
    positions hash the pad, as a training sequence's do). The windows are ``unique_curve``'s.
    """
    from .ngram import window_keys

    out = []
    for n in lengths:
        k = window_keys(keys, windows(stream, n, n_windows, seed))  # (n_windows, n, K)
        out.append(np.mean([len(np.unique(w)) for w in k]))
    return np.array(out)


def capacity(stream: np.ndarray, n_table_layers: int, d_ff: int, d_model: int, max_len: int | None = None,
             n_windows: int = 32, seed: int = 0, *, keys=None, n_key_layers: int = 0) -> dict:
    """Unique tokens and activated STEM parameters vs context length, plus the Heaps fit.

    For a model with n-gram layers pass its key function ``keys`` and ``n_key_layers`` (how many of the
    ``n_table_layers`` are n-gram keyed): the result then also holds ``distinct_keys`` (``D(n)``) and
    ``heaps_keys``, and ``stem_params_activated`` counts ``d_ff · D(n)`` per n-gram layer and
    ``d_ff · U(n)`` per token layer. Without ``keys`` the result is the token model's.
    """
    max_len = min(max_len or len(stream) // 4, len(stream))
    lengths = context_lengths(max_len)
    unique = unique_curve(stream, lengths, n_windows, seed)
    fit = fit_heaps(np.array(lengths), unique)
    stem = n_table_layers * d_ff * unique
    dense_up = n_table_layers * d_model * d_ff
    crossing = next((n for n, u in zip(lengths, unique) if u > d_model), None)
    out = {"context_length": lengths, "unique_tokens": unique.tolist(),
           "stem_params_activated": stem.tolist(), "dense_up_params": dense_up,
           "n_table_layers": n_table_layers, "d_ff": d_ff, "d_model": d_model, "heaps": asdict(fit),
           "first_length_exceeding_dense": crossing, "n_windows": n_windows}
    if keys is None:
        return out
    if not 0 < n_key_layers <= n_table_layers:
        raise ValueError(f"n_key_layers={n_key_layers} must be in 1..n_table_layers={n_table_layers} when keys are given")
    from ..ffn.ngram import keys_per_position

    distinct = distinct_keys_curve(stream, lengths, keys, n_windows, seed)
    stem = (n_table_layers - n_key_layers) * d_ff * unique + n_key_layers * d_ff * distinct
    out.update({"distinct_keys": distinct.tolist(), "heaps_keys": asdict(fit_heaps(np.array(lengths), distinct)),
                "n_key_layers": n_key_layers, "keys_per_position": keys_per_position(keys.cfg),
                "stem_params_activated": stem.tolist(),
                "first_length_exceeding_dense": next((n for n, p in zip(lengths, stem) if p > dense_up), None)})
    return out


def plot_capacity(result: dict, path: str | Path) -> Path:
    """Two panels: unique tokens (with the Heaps fit) and activated STEM parameters vs context length."""
    plt = pyplot()
    n = np.array(result["context_length"])
    fit = HeapsFit(**result["heaps"])
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    ax1.loglog(n, result["unique_tokens"], "o", label="unique tokens U(n)" if "distinct_keys" in result else "measured")
    ax1.loglog(n, fit.predict(n), "-", label=f"U = {fit.K:.2f} n^{fit.beta:.3f} (R² {fit.r2:.3f})")
    rows = "STEM rows: |S|·d_ff·U(n)"
    if "distinct_keys" in result:
        kfit = HeapsFit(**result["heaps_keys"])
        ax1.loglog(n, result["distinct_keys"], "s", label="distinct n-gram keys D(n)")
        ax1.loglog(n, kfit.predict(n), "-", label=f"D = {kfit.K:.2f} n^{kfit.beta:.3f} (R² {kfit.r2:.3f})")
        rows = "table rows: d_ff·(D(n) per n-gram layer + U(n) per token layer)"
    ax1.set_xlabel("context length n (tokens)")
    ax1.set_ylabel("unique tokens U(n)" + (" / keys D(n)" if "distinct_keys" in result else ""))
    ax1.legend(fontsize=8)
    ax2.loglog(n, result["stem_params_activated"], "o-", label=rows)
    ax2.axhline(result["dense_up_params"], color="gray", ls="--", label="dense up-projections: |S|·d·d_ff")
    ax2.set_xlabel("context length n (tokens)")
    ax2.set_ylabel("activated parameters")
    ax2.legend(fontsize=8)
    return save(fig, path)
