"""Gradual insertion: start at exactly the dense model, end as pure STEM.

A model converted to ``stem_dagger`` computes ``W_d (SiLU(W_g x) ⊙ (s·W_u x + r·U[t]))`` in its
table layers. The trainer (``run.anneal``) moves ``s`` from 1 to 0 over the first
``run.anneal_ratio`` of the steps (cosine), so the up-projection is annealed out while the
tables learn to take its place:

* ``dagger``: ``r = 1`` throughout; the tables start at zero (``stemlm convert --ffn stem_dagger``),
  so step 0 is exactly the dense model;
* ``blend``: ``r = 1 − s``; the tables start at calibrated rows (``--init calibrate``), so step 0
  is exactly the dense model and the end is the calibrated STEM model, trained.

Once ``s = 0`` the up-projection no longer acts: ``to_stem`` turns the model into the pure
``stem`` model with the same outputs (``W_u`` dropped).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from ..config import ModelConfig
from ..ffn import KINDS, ffn_kind

ANNEAL_MODES = ("off", "dagger", "blend")


def up_scale_at(step: int, total_steps: int, ratio: float) -> float:
    """``s`` after ``step`` of ``total_steps`` steps: cosine from 1 to 0 over ``ratio·total_steps``, then 0."""
    end = max(1, round(ratio * total_steps))
    progress = min(1.0, step / end)
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def scales_at(mode: str, step: int, total_steps: int, ratio: float) -> tuple[float, float]:
    """``(up_scale, row_scale)`` of ``mode`` at ``step``."""
    if mode not in ANNEAL_MODES:
        raise ValueError(f"unknown anneal mode {mode!r}; choose one of {', '.join(ANNEAL_MODES)}")
    if mode == "off":
        return 1.0, 1.0
    s = up_scale_at(step, total_steps, ratio)
    return (s, 1.0) if mode == "dagger" else (s, 1.0 - s)


def apply_schedule(model, mode: str, step: int, total_steps: int, ratio: float) -> float:
    """Set the scales of ``mode`` at ``step`` on ``model`` (nothing for ``off``); returns ``s``."""
    up, row = scales_at(mode, step, total_steps, ratio)
    if mode != "off":
        set_scales(model, up, row)
    return up


def annealed_layers(model) -> list:
    """The FFNs a schedule acts on: those of the layers whose kind anneals (``FFNKind.anneals_to``)."""
    return [b.ffn for b in model.layers if ffn_kind(b.kind).anneals_to]


def check_annealable(cfg: ModelConfig) -> None:
    """A one-line ``ValueError`` unless every table layer of ``cfg`` is of a kind that anneals."""
    kinds = {cfg.layer_kinds[i] for i in cfg.table_layers}
    can = [name for name, kind in KINDS.items() if kind.anneals_to]
    if not kinds or any(not ffn_kind(k).anneals_to for k in kinds) or len(kinds) > 1:
        raise ValueError(f"run.anneal needs a model whose table layers are all {' or '.join(can)} (convert with "
                         f"--ffn {can[0]}), got {sorted(kinds) or 'no table layers'}")


def set_scales(model, up_scale: float, row_scale: float) -> None:
    """Set ``s`` and ``r`` on every ``stem_dagger`` FFN of ``model``."""
    for ffn in annealed_layers(model):
        ffn.up_scale, ffn.row_scale = float(up_scale), float(row_scale)


@torch.no_grad()
def to_stem(model):
    """The pure ``stem`` model of an annealed ``stem_dagger`` model at ``s = 0``, ``r = 1``.

    The tables and every other weight are shared with ``model`` (not copied); only the unused
    up-projections are left out. Raises ``ValueError`` if the schedule has not reached ``s = 0``.
    """
    from ..checkpoint.directory import model_from_state

    check_annealable(model.cfg)
    for ffn in annealed_layers(model):
        if ffn.up_scale != 0.0 or ffn.row_scale != 1.0:
            raise ValueError(f"the up-projection is not annealed out yet (s={ffn.up_scale:g}, r={ffn.row_scale:g}); "
                             "train until run.anneal_ratio of the steps have passed")
    cfg = model.cfg.replace(ffn=ffn_kind(model.cfg.ffn).anneals_to)
    state = {k: v for k, v in model.state_dict().items()
             if not (k.endswith(".ffn.w_up.weight") and int(k.split(".")[1]) in cfg.table_layers)}
    return model_from_state(cfg, state).train(model.training)


def export_stem(model, out: Path, tokenizer_dir: Path | None = None) -> Path:
    """Write the pure STEM model of an annealed ``model`` (``to_stem``) as a checkpoint at ``out``
    (once: an existing ``out`` is kept); returns ``out``."""
    from ..checkpoint.directory import save_model

    if not Path(out).exists():
        save_model(to_stem(model), out, tokenizer_dir=tokenizer_dir)
    return Path(out)
