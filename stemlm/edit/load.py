"""Load a checkpoint and its tokenizer for editing and analysis (shared by the CLIs)."""

from __future__ import annotations

from pathlib import Path

from ..store import Placement, open_model, placement_of
from .tokens import load_tokenizer


def load_model_and_tokenizer(ckpt: str | Path, data_dir: str | Path | None = None,
                             placement: Placement | str | None = None):
    """``(model, tokenizer)``: the newest checkpoint of ``ckpt`` (a run or checkpoint dir) with its tables
    placed (a ``Placement`` or a tier name; default ``device``), and ``tokenizer.json`` from the checkpoint,
    its run, or ``data_dir``.

    Off the device the tables are opened writable: the disk tier maps the checkpoint copy-on-write, so
    edits never reach the file (a separate ``tables_file`` is written through).
    """
    placement = placement_of(placement)
    model = open_model(ckpt, placement.replace(writable=True) if placement.off_device else placement)
    tokenizer = load_tokenizer(ckpt, data_dir)
    return model, tokenizer
