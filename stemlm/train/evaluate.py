"""Validation loss and perplexity: of a model in memory (during training) or of a checkpoint.

Evaluation reads consecutive, non-overlapping windows from the start of the validation split
(``stemlm.data.iter_eval_batches``), so every evaluation of a run sees the same tokens and the
numbers of different checkpoints and runs are comparable.
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path

import torch

from ..layered_config import yaml_mapping
from ..checkpoint.directory import read_config, resolve_checkpoint
from ..data import TokenDataset, count_eval_batches, iter_eval_batches
from ..runtime.devices import resolve_device
from ..runtime.matmul import apply_matmul
from ..model.quant import codec_of
from ..store import Placement, open_model, placement_of


def compute_loss(model, batch, doc_masking: bool = False) -> torch.Tensor:
    """Mean next-token cross-entropy (nats) of ``batch`` (the model fuses it with its LM head)."""
    return model(batch.inputs, doc_ids=batch.doc_ids if doc_masking else None, targets=batch.targets)


def autocast(device: torch.device, dtype: str, cache: bool = True):
    """bf16 autocast context for ``dtype="bfloat16"``, else a no-op; ``cache=False`` recasts the
    weights at every use (what a captured CUDA graph needs)."""
    if dtype == "bfloat16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16, cache_enabled=cache)
    return contextlib.nullcontext()


@torch.no_grad()
def evaluate(model, ds: TokenDataset, batch_size: int, seq_len: int, max_batches: int,
             dtype: str = "float32", doc_masking: bool = False, progress: bool = False) -> dict:
    """Token-weighted mean loss over the first ``max_batches`` eval batches: ``{loss, ppl, tokens}``.

    ``progress`` shows a progress bar (on stderr) over the batches.
    """
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    total, tokens = 0.0, 0
    batches = iter_eval_batches(ds, batch_size, seq_len, max_batches)
    if progress:
        from tqdm import tqdm
        batches = tqdm(batches, total=min(max_batches, count_eval_batches(ds, batch_size, seq_len)), desc="eval",
                       dynamic_ncols=True, leave=False)
    for batch in batches:
        batch = batch.to(device)
        with autocast(device, dtype):
            loss = compute_loss(model, batch, doc_masking)
        n = batch.targets.numel()
        total += float(loss) * n
        tokens += n
    model.train(was_training)
    if tokens == 0:
        raise ValueError(f"validation split of {ds.path} yields no batch of seq_len {seq_len}")
    mean = total / tokens
    return {"loss": mean, "ppl": math.exp(min(mean, 50.0)), "tokens": tokens}


DEFAULT_EVAL_BATCHES = 50


def evaluate_checkpoint(ckpt: str | Path, data_dir: str | Path | None = None, batches: int | None = None,
                        batch_size: int | None = None, seq_len: int | None = None,
                        placement: Placement | str | None = None, dtype: str = "float32", matmul: str = "auto",
                        progress: bool = False, verify: bool = True) -> dict:
    """Validation loss/perplexity of a checkpoint or of a run's newest checkpoint.

    ``placement`` says where the tables live and the compute device (``stemlm.store.Placement``, or a
    tier name; default: in memory on the CPU, as stored); ``dtype`` is the autocast dtype; ``matmul``
    picks the GEMM kernels as training's ``run.matmul`` does (``stemlm.runtime.matmul``); ``verify``
    checks the checkpoint's checksums first (``stemlm.checkpoint.integrity``).

    ``data_dir``, ``batch_size`` and ``seq_len`` default to the training config stored beside the
    checkpoint (``config.yaml``), the data dir to the default corpus when that is unknown too.
    ``batches=None`` reads the first ``DEFAULT_EVAL_BATCHES`` (or all, if the split has fewer);
    asking for more batches than the split has, or a ``seq_len`` beyond the model's
    ``max_seq_len``, is an error rather than a silent cap. Everything is checked before the
    model is loaded. The result names the batches read.
    """
    path = resolve_checkpoint(ckpt, verify)
    placement = placement_of(placement)
    device = str(resolve_device(placement.device or "cpu"))
    run_cfg = _stored_run_config(path)
    data_dir = data_dir or run_cfg.get("data", {}).get("dir")
    if data_dir is None:
        from ..data import default_data_dir
        data_dir = default_data_dir()
    batch_size = batch_size or run_cfg.get("data", {}).get("batch_size", 8)
    seq_len = read_config(path).check_seq_len(seq_len or run_cfg.get("data", {}).get("seq_len", 128), "seq_len")
    ds = TokenDataset.open(Path(data_dir), "val")
    available = count_eval_batches(ds, batch_size, seq_len)
    if batches is None:
        batches = min(DEFAULT_EVAL_BATCHES, available)
    elif batches > available:
        raise ValueError(f"batches {batches}: the validation split of {data_dir} holds only {available} batches of "
                         f"{batch_size} x {seq_len} tokens; ask for {available} or fewer")
    model = open_model(path, placement.replace(device=device), verify=verify)
    apply_matmul(model, matmul, device, dtype)
    if ds.vocab_size > model.cfg.vocab_size:
        raise ValueError(f"data vocab_size {ds.vocab_size} exceeds the model's {model.cfg.vocab_size}: wrong --data?")
    doc_masking = bool(run_cfg.get("data", {}).get("doc_masking", False))
    out = evaluate(model, ds, batch_size, seq_len, batches, dtype, doc_masking, progress=progress)
    return {**out, "checkpoint": str(path), "data": str(data_dir), "batches": batches, "batches_available": available,
            "batch_size": batch_size, "seq_len": seq_len, "table_dtype": codec_of(model.tables).name}


def _stored_run_config(ckpt: Path) -> dict:
    for candidate in (ckpt / "config.yaml", ckpt.parent.parent / "config.yaml"):
        if candidate.exists():
            return yaml_mapping(candidate.read_text(), f"run config {candidate}")
    return {}


@torch.no_grad()
def loss_by_position(model, ds: TokenDataset, batch_size: int, seq_len: int, max_batches: int,
                     dtype: str = "float32") -> list[float]:
    """Mean next-token loss (nats) at each position ``0 .. seq_len-1`` of the eval windows.

    Plain causal attention over the whole window (no document masking), so position ``p``
    predicts with ``p`` tokens of preceding text: the curve shows how much a longer context helps.
    """
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    total, rows = torch.zeros(seq_len, dtype=torch.float64), 0
    for batch in iter_eval_batches(ds, batch_size, seq_len, max_batches):
        batch = batch.to(device)
        with autocast(device, dtype):
            logits = model(batch.inputs)  # (B, T, V)
        nll = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), batch.targets.flatten(),
                                                reduction="none").view_as(batch.targets)  # (B, T)
        total += nll.sum(0).double().cpu()
        rows += nll.shape[0]
    model.train(was_training)
    if rows == 0:
        raise ValueError(f"validation split of {ds.path} yields no batch of seq_len {seq_len}")
    return (total / rows).tolist()
