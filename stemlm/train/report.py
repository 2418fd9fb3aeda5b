"""End-of-run reporting: the corpus unigram entropy baseline and a comparison of runs."""

from __future__ import annotations

import math
import shlex
from pathlib import Path

import numpy as np

from ..ffn import ffn_kind
from .result import TrainResult
from ..checkpoint.rundir import RunDir


def unigram_entropy(data_dir: str | Path) -> float:
    """Entropy (nats/token) of the train split's token frequencies: the loss of the best model
    that ignores context. A trained LM has to beat it to have learned anything from context."""
    data_dir = Path(data_dir)
    counts_file = data_dir / "train.counts.npy"
    if counts_file.exists():
        counts = np.load(counts_file).astype(np.float64)
    else:
        from ..data import TokenDataset
        ds = TokenDataset.open(data_dir, "train")
        counts = np.bincount(np.asarray(ds.tokens), minlength=ds.vocab_size).astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def summary_lines(results: dict[str, TrainResult], unigram: float | None) -> list[str]:
    """Human-readable lines: per run val loss, perplexity, tokens, time, next to the unigram baseline."""
    lines = []
    if unigram is not None:
        lines.append(f"unigram entropy of the corpus (context-free baseline): {unigram:.3f} nats/token "
                     f"(ppl {math.exp(unigram):.1f})")
    for label, r in results.items():
        val = "n/a" if r.val_loss is None else f"{r.val_loss:.3f} nats/token (ppl {math.exp(min(r.val_loss, 50)):.1f})"
        gain = "" if unigram is None or r.val_loss is None else \
            f", {abs(unigram - r.val_loss):.3f} {'below' if r.val_loss < unigram else 'ABOVE'} the unigram entropy"
        lines.append(f"{label:>10}: val loss {val}{gain}; {r.steps} steps, {r.tokens_seen / 1e6:.2f}M tokens, "
                     f"{r.flops_seen:.3g} FLOPs, {r.seconds:.0f}s, {r.loss_spikes} loss spikes -> {r.run_dir}")
    return lines


def next_steps_lines(result: TrainResult, ffn: str | None = None) -> list[str]:
    """What a run made (checkpoint, plots, logs) and the exact commands to use it next.

    ``ffn`` is the model's FFN kind: the row-swap edit is offered only for models with tables.
    """
    run = shlex.quote(str(result.run_dir))
    made = [("checkpoint", [result.checkpoint] if result.checkpoint else []),
            ("plots", [p for p in (result.run_dir / "loss_vs_tokens.png", result.run_dir / "loss_vs_flops.png") if p.exists()]),
            ("logs", [p for p in (RunDir(result.run_dir).metrics, RunDir(result.run_dir).summary) if p.exists()])]
    lines = ["", "made:"] + [f"  {name:<11} {', '.join(str(f) for f in files)}" for name, files in made if files]
    text = result.checkpoint is not None and (Path(result.checkpoint) / "tokenizer.json").exists()
    lines.append("next:")
    if text:  # generating and editing need the tokenizer the checkpoint carries
        lines.append(f'  stemlm generate --ckpt {run} --prompt "The capital of France is" --max-new-tokens 20')
    lines.append(f"  stemlm eval-ppl --ckpt {run}")
    if text and ffn_kind(ffn).owns_table:
        lines.append(f'  stemlm edit --ckpt {run} --swap Spain=Germany --prompt "The capital of Spain is"')
    config = shlex.quote(str(result.run_dir / "config.yaml"))
    lines.append(f"  stemlm train --config {config} --resume run.steps={2 * result.steps}   # train on to twice the steps")
    return lines
