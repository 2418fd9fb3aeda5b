"""Which layers a conversion replaces: the ones whose FFN the fitted rows stand in for at the least cost.

Pretraining places STEM layers at uniform intervals (the paper's 1/3, 1/2, full). A conversion of a
trained model can do better: layers differ a lot in how far their up-projection ``W_u x`` is a
function of the current token alone. In SmolLM2-135M, converting one layer costs between 0.24 nats
of KL (layer 0) and 0.03 (the middle layers 14–17; the last layers cost up to 0.19) on the dense
model's own next-token distribution (benchmarks/results/insertion_grid.json, ``default-262k``).

The reference distribution is kept as the dense model's final hidden states of the probe windows
(``d`` wide) and turned into log-probabilities again at every layer: one ``lm_head`` product a layer
instead of ``V``-wide log-probabilities held for the whole pass (0.8 GB at SmolLM2's vocabulary).

``layer_costs`` measures that cost for every layer in one pass of the dense model: at each layer the
rows are fitted on the dense stream (the calibration's own method and ``W_d`` refit, on at most
``score_tokens`` of the calibration windows), that layer alone is replaced, the rest of the dense
model runs on a few probe windows, and the cost is the mean per-token ``KL(dense ‖ converted)`` of
the next-token distribution. ``cheapest_layers`` keeps the placement's count and picks the layers
of least cost. Layers interact (errors compound), so the sum of single-layer costs is only a guide
to the converted model's loss; the step-0 grid (docs/insertion.md) measures the real thing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch
import torch.nn.functional as F

from ..ffn import ffn_kind
from ..model.decoder import StemLM, rope_cos_sin
from ..runtime.cache import cached_json

SCORE_TOKENS = 65_536  # calibration tokens the per-layer fits of the scoring pass use (at most)
PROBE_WINDOWS = 16  # windows the KL is measured on
# what the scoring pass leaves out of a calibration (each layer is fitted alone, on the dense stream): these
# settings take their defaults there, so conversions that differ only in them share one measurement
NOT_SCORED = ("als_rounds", "distill_steps", "distill_lr", "distill_batch", "distill_down", "distill_gate",
              "correct_drift")


def scoring_config(calib):
    """``calib`` (a ``CalibrationConfig``) as the scoring pass fits with it: ``NOT_SCORED`` at their defaults."""
    defaults = type(calib)()
    return replace(calib, **{name: getattr(defaults, name) for name in NOT_SCORED})


@torch.no_grad()
def layer_costs(dense: StemLM, kind: str, ids: torch.Tensor, calib, score_tokens: int = SCORE_TOKENS,
                probe_windows: int = PROBE_WINDOWS, progress: bool = True,
                log: Callable[[str], None] = lambda s: None) -> list[float]:
    """Per layer, the mean per-token KL (nats) of the dense model's next-token distribution when that
    layer alone becomes ``kind`` with rows fitted by ``calib`` (a ``CalibrationConfig``; its alternating
    least squares and distillation are left out here) over the calibration windows ``ids (n_seq, T)``.

    The fits use evenly spaced windows of ``ids`` (at most ``score_tokens`` tokens); the KL is measured on
    ``probe_windows`` of them. Runs where ``dense`` is.
    """
    from tqdm import tqdm

    from .calibrate import chunk_slices, fit_layer, fitted_kind
    from .distill import layer_output

    dense = dense.float().eval()
    device = dense.tok_embeddings.weight.device
    n_seq, T = ids.shape
    keep = max(1, min(n_seq, score_tokens // T))
    ids = ids[torch.linspace(0, n_seq - 1, keep).round().long()].to(device)  # (keep, T) evenly spaced
    probe = torch.linspace(0, keep - 1, min(keep, probe_windows)).round().long().to(device)
    calib = scoring_config(calib)
    kind = fitted_kind(kind, calib)
    cos, sin = (t.to(device) for t in rope_cos_sin(torch.arange(T), dense.cfg.head_dim, dense.cfg.rope_theta,
                                                   torch.float32))
    chunks = chunk_slices(keep, calib.chunk)
    layers = dense.layers

    def final(h: torch.Tensor, start: int) -> torch.Tensor:  # the stream entering layer `start` → the last one
        for block in layers[start:]:
            h = h + block.attn(block.attn_norm(h), cos, sin, 0)
            h = h + block.ffn(block.ffn_norm(h))
        return h

    def log_probs(h: torch.Tensor) -> torch.Tensor:  # (n, T, d) final stream → (n, T, V)
        return F.log_softmax(dense.lm_head(dense.norm(h)).float(), -1)

    probe_parts = chunk_slices(len(probe), 4)
    reference = [final(dense.tok_embeddings(ids[probe[p]]), 0) for p in probe_parts]  # (4, T, d) each, not (.., V)
    stream = torch.cat([dense.tok_embeddings(ids[c]) for c in chunks])  # (keep, T, d)
    costs = []
    for i, block in enumerate(tqdm(layers, desc="layer costs", disable=not progress, dynamic_ncols=True)):
        for c in chunks:
            h = stream[c]
            h += block.attn(block.attn_norm(h), cos, sin, 0)
        rows, weights = fit_layer(block, kind, stream, ids, chunks, calib, dense.tok_embeddings.weight, True)
        kl, n = 0.0, 0
        for p, ref in zip(probe_parts, reference):
            h = stream[probe[p]]
            x = block.ffn_norm(h)
            lp = log_probs(final(h + layer_output(block.ffn, kind, x, rows[ids[probe[p]]], weights), i + 1))
            ref = log_probs(ref)
            kl += float((ref.exp() * (ref - lp)).sum())
            n += lp.shape[0] * lp.shape[1]
        costs.append(kl / n)
        log(f"layer {i}: converting it alone costs {costs[-1]:.4f} nats of KL a token")
        del rows, weights
        for c in chunks:
            h = stream[c]
            h += block.ffn(block.ffn_norm(h))
    return costs


def cheapest_layers(costs: list[float], count: int) -> list[int]:
    """The ``count`` layers of least cost, in layer order (ties go to the earlier layer)."""
    if not 0 < count <= len(costs):
        raise ValueError(f"cannot choose {count} of {len(costs)} layers")
    return sorted(sorted(range(len(costs)), key=lambda i: (costs[i], i))[:count])


def cached_layer_costs(key: str, compute: Callable[[], list[float]]) -> list[float]:
    """``compute()``, kept under ``$STEMLM_CACHE/layer-costs/`` (``stemlm.runtime.cache``): ``key`` digests the
    model, the text and the scoring settings (``scoring_config``), so a resumed conversion, or another one that
    differs only in what the scoring leaves out (distillation, drift correction, ALS), does not measure again."""
    costs, _ = cached_json("layer-costs", key, compute,
                           valid=lambda v: isinstance(v, list) and all(isinstance(c, (int, float)) for c in v))
    return [float(c) for c in costs]
