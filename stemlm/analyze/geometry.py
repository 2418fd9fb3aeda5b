"""Geometry of FFN "addresses" (paper Fig. 4): pairwise cosine similarity distributions.

For each layer and a real text sample:

* ``stem_rows``   — table rows ``U_l[t]`` of the distinct tokens of the sample (STEM layers);
* ``up_proj``     — dense up-projection outputs ``W_u x`` at every position (dense layers of the
                    model, or of a separate dense model given as ``dense``: the paper compares
                    a STEM layer's rows with the dense model's up-projection in the same layer);
* ``gated``       — ``SiLU(W_g x) ⊙ U_l[t]`` at every position (STEM layers): the vector that
                    actually addresses ``W_d``.

``x`` (the normed FFN input) is captured with forward hooks on ``model.layers[i].ffn``. Low
mean ``|cos|`` means the vectors are spread out (close to orthogonal), i.e. many distinct
directions address ``W_d``. Positions and tokens are subsampled to ``max_points`` (seeded).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ..ffn import ffn_kind
from ..runtime.plotting import pyplot, save

BINS = np.linspace(-1.0, 1.0, 101)
KINDS = ("stem_rows", "up_proj", "gated")


def pairwise_cos(vectors: torch.Tensor) -> torch.Tensor:
    """Cosine similarities of every unordered pair of rows of ``(N, D)`` -> ``(N(N-1)/2,)``."""
    v = F.normalize(vectors.float(), dim=-1)
    sims = v @ v.T  # (N, N)
    i, j = torch.triu_indices(len(v), len(v), offset=1)
    return sims[i, j]


def summarize(cos: torch.Tensor) -> dict:
    """Mean |cos|, mean, std and percentiles of a set of cosine similarities, and a histogram."""
    c = cos.double().numpy()
    counts, _ = np.histogram(c, bins=BINS)
    pct = np.percentile(c, [5, 25, 50, 75, 95])
    return {"n_pairs": int(c.size), "mean_abs": float(np.abs(c).mean()), "mean": float(c.mean()), "std": float(c.std()),
            "p5": pct[0], "p25": pct[1], "p50": pct[2], "p75": pct[3], "p95": pct[4],
            "p95_abs": float(np.percentile(np.abs(c), 95)), "hist": counts.tolist()}


@torch.no_grad()
def capture_ffn_inputs(model, ids: torch.Tensor, layers: list[int]) -> dict[int, torch.Tensor]:
    """Normed FFN inputs ``x`` of the given layers for token ids ``(B, T)``: ``{layer: (B, T, d)}``."""
    captured, handles = {}, []
    for i in layers:
        def hook(module, args, output, i=i):
            captured[i] = args[0].detach().float().cpu()
        handles.append(model.layers[i].ffn.register_forward_hook(hook))
    try:
        model(ids)
    finally:
        for h in handles:
            h.remove()
    return captured


def _subsample(n: int, max_points: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randperm(n, generator=gen)[:max_points].sort().values


def _vectors(model, layer: int, x: torch.Tensor, ids: torch.Tensor, pick: torch.Tensor, uniq: torch.Tensor) -> dict:
    """The address vectors of one layer: ``x (N, d)`` and ``ids (N,)`` are flattened positions."""
    ffn, kind, out = model.layers[layer].ffn, model.cfg.layer_kinds[layer], {}
    w = lambda lin: lin.weight.detach().float().cpu()  # noqa: E731
    if ffn_kind(kind).owns_table:
        table = model.tables[str(layer)]
        out["stem_rows"] = table.read_rows(uniq).float().cpu()  # (U, d_ff)
        if ffn_kind(kind).table_from == "w_up":  # rows that stand for W_u x are gated by SiLU(W_g x)
            rows = table.read_rows(ids[pick]).float().cpu()  # (P, d_ff)
            out["gated"] = F.silu(x[pick] @ w(ffn.w_gate).T) * rows
    if hasattr(ffn, "w_up") and isinstance(ffn.w_up, torch.nn.Linear):
        out["up_proj"] = x[pick] @ w(ffn.w_up).T  # (P, d_ff)
    return out


def geometry(model, ids: torch.Tensor, dense=None, max_points: int = 1500, seed: int = 0) -> dict:
    """Per-layer summaries of the pairwise cosine distributions (see module docstring).

    ``ids (B, T)`` is the text sample; ``dense`` an optional dense model of the same depth whose
    up-projection outputs are reported for every layer as ``dense_up_proj``.
    """
    model.eval()
    n_layers = len(model.layers)
    flat_ids = ids.reshape(-1)
    pick = _subsample(len(flat_ids), max_points, seed)
    uniq = torch.unique(flat_ids)
    uniq = uniq[_subsample(len(uniq), max_points, seed + 1)]
    xs = capture_ffn_inputs(model, ids, list(range(n_layers)))
    dense_xs = None
    if dense is not None:
        if len(dense.layers) != n_layers:
            raise ValueError(f"dense model has {len(dense.layers)} layers, the STEM model {n_layers}")
        dense_xs = capture_ffn_inputs(dense, ids, list(range(n_layers)))
    layers = []
    for i in range(n_layers):
        vecs = _vectors(model, i, xs[i].reshape(len(flat_ids), -1), flat_ids, pick, uniq)
        if dense_xs is not None:
            dx = dense_xs[i].reshape(len(flat_ids), -1)[pick]
            vecs["dense_up_proj"] = dx @ dense.layers[i].ffn.w_up.weight.detach().float().cpu().T
        layers.append({"layer": i, "kind": model.cfg.layer_kinds[i],
                       **{name: summarize(pairwise_cos(v)) for name, v in vecs.items()}})
    # mean |cos| of independent Gaussian vectors in d_ff dimensions: the "no structure" reference
    random_ref = float(np.sqrt(2.0 / (np.pi * model.cfg.d_ff)))
    return {"n_positions": int(len(pick)), "n_unique_tokens": int(len(uniq)), "random_mean_abs": random_ref,
            "bins": BINS.tolist(), "layers": layers}


def plot_geometry(result: dict, path: str | Path) -> Path:
    """One panel per layer with the cosine histograms (densities) of every vector kind present."""
    plt = pyplot()
    layers = result["layers"]
    cols = min(4, len(layers))
    rows = (len(layers) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(3.6 * cols, 2.8 * rows), squeeze=False)
    centers = (BINS[:-1] + BINS[1:]) / 2
    for ax, layer in zip(axes.flat, layers):
        for name in (*KINDS, "dense_up_proj"):
            if name in layer:
                h = np.asarray(layer[name]["hist"], dtype=np.float64)
                ax.plot(centers, h / max(h.sum(), 1), label=f"{name} (|cos| {layer[name]['mean_abs']:.2f})")
        ax.set_title(f"layer {layer['layer']} ({layer['kind']})", fontsize=9)
        ax.set_xlabel("cosine similarity", fontsize=8)
        ax.legend(fontsize=6)
    for ax in list(axes.flat)[len(layers):]:
        ax.axis("off")
    return save(fig, path)
