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


def build_model(cfg: TrainConfig, vocab_size: int, data_dir: Path | None = None) -> StemLM:
    """A fresh model from ``cfg.model`` (vocab from the data unless set), or ``run.init_from``
    with the explicitly set ``model.*`` fields applied (e.g. ``max_seq_len`` for context extension).

    A model built with ``ngram_normalize`` gets its token -> canonical token map from the tokenizer of
    ``data_dir`` (``fill_canonical``), once: the map is a buffer saved with every checkpoint, so a
    resumed run or a loaded model needs no tokenizer (``run.init_from`` keeps the map it has)."""
    if not cfg.run.init_from:
        torch.manual_seed(cfg.run.seed)
        model = StemLM(cfg.model.build(vocab_size=vocab_size))
        return fill_canonical(model, data_dir) if model.cfg.ngram_normalize else model
    base = open_model(cfg.run.init_from)
    if (codec := codec_of(base.tables)).quantized:
        raise ConfigError(f"run.init_from: {cfg.run.init_from} stores its tables as {codec.name}, which cannot be trained; "
                          f"write fp32 tables first: stemlm convert --ckpt {cfg.run.init_from} --table-dtype fp32 --out DIR")
    overrides = cfg.model.overrides()
    if not overrides:
        return base
    model = StemLM(base.cfg.replace(**overrides))
    newly_normalized = model.ngram_keys is not None and model.cfg.ngram_normalize and not (
        base.ngram_keys is not None and base.cfg.ngram_normalize)
    try:
        result = model.load_state_dict(base.state_dict(), strict=False)
        if result.unexpected_keys or set(result.missing_keys) - ({"ngram_keys.canon"} if newly_normalized else set()):
            model.load_state_dict(base.state_dict())  # raises, naming the keys (a new canon map is filled below)
    except RuntimeError as e:
        raise ConfigError(f"model overrides {sorted(overrides)} change tensor shapes of run.init_from: {str(e).splitlines()[0]}") from None
    return fill_canonical(model, data_dir) if newly_normalized else model


def fill_canonical(model: StemLM, data_dir: Path | None) -> StemLM:
    """``model`` with ``ngram_keys.canon`` filled from ``stemlm.data.codec.canonical_ids`` of the tokenizer
    of the prepared ``data_dir`` (``model.ngram_normalize``: n-gram keys hash canonical tokens); a one-line
    ``ConfigError`` when there is no tokenizer to read. A model without n-gram layers is returned as is."""
    if model.ngram_keys is None or model.ngram_keys.canon is None:
        return model
    from ..data.codec import canonical_ids
    from ..data.tokenizer import find_tokenizer

    try:
        found = find_tokenizer(data_dir, hint="model.ngram_normalize needs the data's tokenizer to map tokens to "
                                              "their canonical forms")
    except (FileNotFoundError, ValueError) as e:
        raise ConfigError(str(e)) from None
    with torch.no_grad():
        model.ngram_keys.canon.copy_(canonical_ids(found.tokenizer, model.cfg.vocab_size))
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
