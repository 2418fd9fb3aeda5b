"""What a study records per run beyond the trainer's own metrics, and the two ROI definitions.

**Loss-based ROI** (quality gained per FLOP spent, relative to dense). The quality of a language
model on a corpus is measured as the nats per token it gains over the best model that ignores
context, the unigram entropy ``H`` of the corpus: ``Q = H - L`` for validation loss ``L``. Then

    ROI_loss = (Q / F) / (Q_dense / F_dense) = ((H - L) / F) / ((H - L_dense) / F_dense)

with ``F`` the training FLOPs per token (``accounting.train_flops_per_token``; all runs see the
same tokens, so this is also the ratio of total training FLOPs). ROI_loss > 1: more quality per
FLOP than dense. The paper's Table 3 ROI is ``accounting.roi`` on eval accuracy:
``(acc / F) / (acc_dense / F_dense)``.
"""

from __future__ import annotations

from itertools import accumulate

import numpy as np
import torch

from .. import accounting as acc
from ..config import ModelConfig


def loss_roi(loss: float, flops: float, base_loss: float, base_flops: float, unigram_entropy: float) -> float | None:
    """``((H - L) / F) / ((H - L_base) / F_base)``; None when the baseline gained nothing over ``H``."""
    base_gain = unigram_entropy - base_loss
    if base_gain <= 0 or min(flops, base_flops) <= 0:
        return None
    return ((unigram_entropy - loss) / flops) / (base_gain / base_flops)


def accounting_summary(cfg: ModelConfig, seq_len: int) -> dict:
    """Parameters, per-token FLOPs and decode bytes of ``cfg`` at training length ``seq_len``."""
    return {"total_params": acc.total_params(cfg), "active_params": acc.active_params(cfg),
            "active_params_embedding_row": acc.active_params(cfg, embedding="row"),
            "train_flops_per_token": acc.train_flops_per_token(cfg, seq_len),
            "forward_flops_per_token": acc.forward_flops_per_token(cfg, seq_len),
            "decode_param_bytes_bf16": acc.decode_param_bytes(cfg, dtype_bytes=2),
            "ffn": cfg.ffn, "d_ff": cfg.d_ff, "layer_kinds": list(cfg.layer_kinds), "n_experts": cfg.n_experts,
            "seq_len": seq_len}


def curves(records: list[dict], max_train_points: int = 200) -> dict:
    """Validation and (subsampled) training loss against step, tokens, FLOPs and wall time.

    Wall time is the running sum of the steps' ``step_time`` (training only: evaluation and
    checkpoint writing are excluded, so runs are comparable whatever their eval settings).
    """
    wall = list(accumulate(r.get("step_time", 0.0) for r in records))
    val = [{"step": r["step"], "tokens": r["tokens_seen"], "flops": r["flops_seen"], "wall": w, "val_loss": r["val_loss"]}
           for r, w in zip(records, wall) if r.get("val_loss") is not None]
    every = max(1, len(records) // max_train_points)
    train = [[r["step"], r["loss"], w] for i, (r, w) in enumerate(zip(records, wall))
             if i % every == 0 or i == len(records) - 1]
    losses = [r["loss"] for r in records]
    return {"val": val, "train": train, "train_seconds": wall[-1] if wall else 0.0,
            "max_train_loss": max(losses) if losses else None,
            "spike_steps": [r["step"] for r in records if r.get("spike")]}


def capacity_summary(stream: np.ndarray, cfg: ModelConfig, seq_len: int) -> dict | None:
    """Heaps'-law fit of distinct tokens vs context length and the table parameters one sequence of
    ``seq_len`` activates (``stemlm.analyze.capacity``); None for a model without tables."""
    from ..analyze import capacity

    n_tables = len(cfg.table_layers)
    if n_tables == 0 or len(stream) < 4 * seq_len:
        return None
    c = capacity(stream, n_tables, cfg.d_ff, cfg.d_model, max_len=seq_len, n_windows=16)
    return {"heaps": c["heaps"], "unique_tokens_at_seq_len": c["unique_tokens"][-1],
            "table_params_activated_at_seq_len": c["stem_params_activated"][-1],
            "dense_up_params": c["dense_up_params"], "first_length_exceeding_dense": c["first_length_exceeding_dense"]}


def geometry_summary(model, ids: torch.Tensor, max_points: int = 300) -> dict | None:
    """Mean |cos| of table rows and of up-projection outputs per layer (``stemlm.analyze.geometry``,
    paper Fig. 4) on the ids ``(B, T)``; None for a model without tables."""
    from ..analyze import geometry

    if not model.cfg.table_layers:
        return None
    g = geometry(model, ids, max_points=max_points)
    layers = [{"layer": layer["layer"], "kind": layer["kind"],
               **{f"{k}_mean_abs_cos": v["mean_abs"] for k, v in layer.items() if isinstance(v, dict)}}
              for layer in g["layers"]]
    return {"random_mean_abs_cos": g["random_mean_abs"], "n_positions": g["n_positions"], "layers": layers}
