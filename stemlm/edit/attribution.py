"""Where a fact lives: edits through the calibrated rows of one layer (or a set) of a dense model.

The model is a dense model converted to ``stem_dagger`` in every candidate layer with tables
holding the *calibrated* STEM rows (``stemlm convert --ffn stem_dagger --init calibrate
--calib-dagger-rows fit``). With the gradual-insertion scales (``stemlm.insert.anneal``) every
layer can be switched between the dense layer (``s = 1, r = 0``) and its pure STEM replacement
(``s = 0, r = 1``) without reloading anything. ``stem_at(model, S)`` makes exactly the layers of
``S`` STEM: the dense model with STEM placed at ``S``. Swapping two entities' rows in ``S`` then
measures how much of a fact the rows of ``S`` carry; one layer at a time is a per-layer attribution.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from dataclasses import replace

from ..ffn import ffn_kind
from ..insert.anneal import annealed_layers, check_annealable
from .evaluate import EditEvalConfig, run_edit_eval


@contextlib.contextmanager
def stem_at(model, layers: Iterable[int]):
    """Within the block, the table layers in ``layers`` compute pure STEM and the others their
    dense layer; the scales are restored afterwards."""
    check_annealable(model.cfg)
    chosen = {int(i) for i in layers}
    unknown = chosen - set(model.cfg.table_layers)
    if unknown:
        raise ValueError(f"layers {sorted(unknown)} have no table (table layers: {list(model.cfg.table_layers)})")
    saved = [(f, f.up_scale, f.row_scale) for f in annealed_layers(model)]
    try:
        for i, block in enumerate(model.layers):
            if ffn_kind(block.kind).anneals_to:  # its scales choose between the dense layer and pure STEM
                block.ffn.up_scale, block.ffn.row_scale = (0.0, 1.0) if i in chosen else (1.0, 0.0)
        yield model
    finally:
        for f, up, row in saved:
            f.up_scale, f.row_scale = up, row


def placement_edits(model, tokenizer, facts: list[dict], cfg: EditEvalConfig, placements: dict[str, list[int]],
                    progress: bool = True) -> dict:
    """``run_edit_eval`` with STEM placed at each of ``placements`` (label -> layers) and the edit
    applied to those layers; ``{label: result}``. The known facts are those of each placed model."""
    out = {}
    for label, layers in placements.items():
        with stem_at(model, layers):
            out[label] = run_edit_eval(model, tokenizer, facts, replace(cfg, layer_sets={label: list(layers)}),
                                       progress=progress)
    return out


def per_layer(model, tokenizer, facts: list[dict], cfg: EditEvalConfig, layers: Iterable[int] | None = None,
              progress: bool = True) -> dict:
    """``placement_edits`` with every single table layer (or those given) as its own placement."""
    chosen = list(model.cfg.table_layers if layers is None else layers)
    return placement_edits(model, tokenizer, facts, cfg, {str(i): [i] for i in chosen}, progress)
