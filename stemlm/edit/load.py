"""Load a checkpoint and its tokenizer for editing and analysis (shared by the CLIs)."""

from __future__ import annotations

from pathlib import Path

from ..data.codec import load_codec
from ..checkpoint.directory import resolve_checkpoint
from ..store import Placement, open_model, placement_of


def load_model_and_tokenizer(ckpt: str | Path, data_dir: str | Path | None = None,
                             placement: Placement | str | None = None):
    """``(model, codec)``: the newest checkpoint of ``ckpt`` (a run or checkpoint dir) with its tables
    placed (a ``Placement`` or a tier name; default ``device``), and the ``TextCodec`` of the tokenizer of
    the checkpoint, its run, or ``data_dir``.

    Off the device the tables are opened writable: the disk tier maps the checkpoint copy-on-write, so
    edits never reach the file (a separate ``tables_file`` is written through).
    """
    placement = placement_of(placement)
    model = open_model(ckpt, placement.replace(writable=True) if placement.off_device else placement)
    codec = load_codec(resolve_checkpoint(ckpt), data_dir=data_dir, hint="pass --data DIR with a prepared corpus")
    return model, codec
