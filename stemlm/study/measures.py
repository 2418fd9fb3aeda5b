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


def curves(records: list[dict]) -> dict:
    """Validation loss against step, tokens, FLOPs and wall time, and every training step's loss.

    Wall time is the running sum of the steps' ``step_time`` (training only: evaluation and
    checkpoint writing are excluded, so runs are comparable whatever their eval settings). ``train``
    holds ``[step, loss, wall, grad_norm, lr]`` for every step (5 significant digits).
    """
    wall = list(accumulate(r.get("step_time", 0.0) for r in records))
    val = [{"step": r["step"], "tokens": r["tokens_seen"], "flops": r["flops_seen"], "wall": w, "val_loss": r["val_loss"]}
           for r, w in zip(records, wall) if r.get("val_loss") is not None]
    train = [[r["step"], _sig(r["loss"]), _sig(w), _sig(r.get("grad_norm")), _sig(r.get("lr"))]
             for r, w in zip(records, wall)]
    losses = [r["loss"] for r in records]
    return {"val": val, "train": train, "train_seconds": wall[-1] if wall else 0.0,
            "max_train_loss": max(losses) if losses else None,
            "spike_steps": [r["step"] for r in records if r.get("spike")]}


def _sig(x, digits: int = 5):
    return None if x is None else float(f"{x:.{digits}g}")


def capacity_summary(stream: np.ndarray, cfg: ModelConfig, seq_len: int, keys=None) -> dict | None:
    """Heaps'-law fit of distinct tokens vs context length and the table parameters one sequence of
    ``seq_len`` activates (``stemlm.analyze.capacity``); None for a model without tables.

    A model with n-gram layers activates rows by keys: the summary adds the distinct keys at
    ``seq_len`` and their Heaps fit (``heaps_keys``), and counts its n-gram layers' activated
    parameters from keys. ``keys`` is the model's key function (``model.ngram_keys``, which holds a
    trained ``canon`` map); by default it is rebuilt from ``cfg``.
    """
    from ..analyze import capacity

    n_tables = len(cfg.table_layers)
    if n_tables == 0 or len(stream) < 4 * seq_len:
        return None
    extra = {}
    if cfg.ngram_layers:
        from ..analyze.ngram import ngram_key_function

        extra = {"keys": keys if keys is not None else ngram_key_function(cfg), "n_key_layers": len(cfg.ngram_layers)}
    c = capacity(stream, n_tables, cfg.d_ff, cfg.d_model, max_len=seq_len, n_windows=16, **extra)
    out = {"heaps": c["heaps"], "unique_tokens_at_seq_len": c["unique_tokens"][-1],
           "table_params_activated_at_seq_len": c["stem_params_activated"][-1],
           "dense_up_params": c["dense_up_params"], "first_length_exceeding_dense": c["first_length_exceeding_dense"]}
    if extra:
        out.update({"heaps_keys": c["heaps_keys"], "distinct_keys_at_seq_len": c["distinct_keys"][-1],
                    "n_key_layers": c["n_key_layers"], "table_params_from": "keys"})
    return out


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


@torch.no_grad()
def val_batch_losses(model, ds, batch_size: int, seq_len: int, batches: int, dtype: str = "float32",
                     doc_masking: bool = False) -> list[float]:
    """The mean loss of each of the first ``batches`` validation batches (the eval-batch noise of one run)."""
    from ..data import iter_eval_batches
    from ..train.evaluate import autocast, compute_loss

    was = model.training
    model.eval()
    device = next(model.parameters()).device
    out = []
    for batch in iter_eval_batches(ds, batch_size, seq_len, batches):
        batch = batch.to(device)
        with autocast(device, dtype):
            out.append(float(compute_loss(model, batch, doc_masking)))
    model.train(was)
    return out


def run_probes(model, data_dir, probes: dict, log=print) -> dict:
    """The probes of ``probes`` (``{"knowledge": {limit}, "needle": {trials, lengths, depths, key}}``) on an
    in-memory model whose tokenizer is in ``data_dir``; a probe whose data is missing is skipped (noted)."""
    from pathlib import Path

    from ..data import load_facts
    from .probes import knowledge_probe, lm_for, needle_probe, needle_values

    if not (Path(data_dir) / "tokenizer.json").exists():
        return {kind: {"skipped": f"{data_dir} holds no tokenizer.json"} for kind in probes}
    out, lm = {}, lm_for(model, data_dir)
    if (k := probes.get("knowledge")) is not None:
        try:
            facts = load_facts(Path(data_dir))
        except FileNotFoundError:
            out["knowledge"] = {"skipped": f"{data_dir} holds no facts"}
        else:
            out["knowledge"] = knowledge_probe(lm, facts, k.get("limit"))
    if (n := probes.get("needle")) is not None:
        values = needle_values(n.get("key", "number"), Path(data_dir) / "tokenizer.json")
        out["needle"] = needle_probe(lm, int(n.get("trials", 4)), int(n.get("seed", 0)), n.get("lengths"),
                                     tuple(n["depths"]) if n.get("depths") else None, values)
    model.train()
    return out
