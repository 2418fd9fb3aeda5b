"""What a run is built from: its data dir, its model (fresh or from ``run.init_from``), compiled blocks."""

from __future__ import annotations

from pathlib import Path

import torch

from ..store import open_model
from ..config import ConfigError
from ..data import looks_prepared, prepare_default_corpus, prepare_user_data
from ..model.decoder import StemLM
from ..model.quant import codec_of
from .config import TrainConfig


def resolve_data_dir(cfg: TrainConfig) -> Path:
    """The prepared data dir a run trains on: ``data.dir`` itself when it is one (or does not exist:
    the dataset then says so); raw text there (file or directory) prepared once into the cache with
    a BPE of the explicitly set ``model.vocab_size``; or, with no ``data.dir``, the default corpus."""
    if cfg.data.dir:
        path = Path(cfg.data.dir)
        if not path.exists() or looks_prepared(path):
            return path
        return prepare_user_data(path, cfg.model.overrides().get("vocab_size"))
    return Path(prepare_default_corpus())


def build_model(cfg: TrainConfig, vocab_size: int) -> StemLM:
    """A fresh model from ``cfg.model`` (vocab from the data unless set), or ``run.init_from``
    with the explicitly set ``model.*`` fields applied (e.g. ``max_seq_len`` for context extension)."""
    if not cfg.run.init_from:
        torch.manual_seed(cfg.run.seed)
        return StemLM(cfg.model.build(vocab_size=vocab_size))
    base = open_model(cfg.run.init_from)
    if (codec := codec_of(base.tables)).quantized:
        raise ConfigError(f"run.init_from: {cfg.run.init_from} stores its tables as {codec.name}, which cannot be trained; "
                          f"write fp32 tables first: stemlm convert --ckpt {cfg.run.init_from} --table-dtype fp32 --out DIR")
    overrides = cfg.model.overrides()
    if not overrides:
        return base
    model = StemLM(base.cfg.replace(**overrides))
    try:
        model.load_state_dict(base.state_dict())
    except RuntimeError as e:
        raise ConfigError(f"model overrides {sorted(overrides)} change tensor shapes of run.init_from: {str(e).splitlines()[0]}") from None
    return model


def compile_blocks(model: StemLM) -> None:
    """``torch.compile`` each transformer block in place (``run.compile``).

    Per block rather than the whole model: the table lookups (data-dependent ``unique``) and the
    chunked loss stay eager outside the compiled regions, blocks of the same kind share one graph,
    and parameter names are unchanged (checkpoints are the same as eager ones). Measured effect:
    docs/training.md ("Benchmarks").
    """
    for block in model.layers:
        block.compile()
