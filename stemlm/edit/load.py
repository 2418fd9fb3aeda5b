"""Load a checkpoint and its tokenizer for editing and analysis (shared by the CLIs)."""

from __future__ import annotations

from pathlib import Path

from ..interop.checkpoint import load_model, resolve_checkpoint
from ..config import check_tier
from .tokens import load_tokenizer


def load_model_and_tokenizer(ckpt: str | Path, data_dir: str | Path | None = None, tables: str = "device"):
    """``(model, tokenizer)``: the newest checkpoint of ``ckpt`` (a run or checkpoint dir), tables on
    the requested tier, and ``tokenizer.json`` from the checkpoint, its run, or ``data_dir``.

    ``host`` and ``disk`` serve the tables through ``stemlm.store``; the disk tier maps the
    checkpoint copy-on-write, so edits never reach the file.
    """
    check_tier(tables)
    path = resolve_checkpoint(ckpt)
    if tables == "device":
        model = load_model(path)
    else:
        from ..store import load_model_with_tables

        model, _ = load_model_with_tables(path, tier=tables, writable=True)
        model.eval()
    tokenizer = load_tokenizer(ckpt, data_dir)
    return model, tokenizer
