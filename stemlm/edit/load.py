"""Load a checkpoint and its tokenizer for editing and analysis (shared by the CLIs)."""

from __future__ import annotations

from pathlib import Path

from ..checkpoint import load_model, resolve_checkpoint
from .tokens import load_tokenizer

TIERS = ("device", "host", "disk")


def load_model_and_tokenizer(ckpt: str | Path, data_dir: str | Path | None = None, tables: str = "device"):
    """``(model, tokenizer)``: the newest checkpoint of ``ckpt`` (a run or checkpoint dir), tables on
    the requested tier, and ``tokenizer.json`` from the checkpoint, its run, or ``data_dir``."""
    if tables not in TIERS:
        raise ValueError(f"unknown table tier {tables!r}; choose one of {', '.join(TIERS)}")
    path = resolve_checkpoint(ckpt)
    model = load_model(path, skip_tables=tables != "device")
    if tables != "device":
        install_tables(model, path, tables)
    tokenizer = load_tokenizer(path, Path(ckpt), data_dir)
    return model, tokenizer


def install_tables(model, ckpt_dir: Path, tier: str) -> None:
    """Serve the tables from host RAM or disk through ``stemlm.store`` (edits write through it)."""
    try:
        from .. import store
    except ImportError:
        raise ValueError(f"--tables {tier} needs the stemlm.store module, which is not available") from None
    store.install(model, ckpt_dir, tier)
