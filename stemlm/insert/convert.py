"""``stemlm convert --init calibrate``: a dense Llama into STEM with tables fitted to its activations.

The dense model is converted exactly first (``ffn=dense``), the calibration text is tokenized with
its own tokenizer, ``calibrate`` fits the tables layer by layer into a work directory next to the
output (``<out>.calibrating``, kept if the pass is interrupted so the next call resumes), and the
checkpoint is streamed to disk from the dense weights and the memory-mapped tables.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np

from ..config import ModelConfig
from ..model.decoder import StemLM
from .calibrate import CalibrationConfig, assemble, calibrate, calibration_windows


def calibration_tokens(source: str | Path | None, tokenizer, vocab_size: int, progress: bool = True) -> np.ndarray:
    """The calibration token stream in the model's vocabulary.

    ``source``: None (the default offline corpus), a prepared data dir (``stemlm data``; its
    training split), or raw text (a file or a directory of .txt/.md/.jsonl). Raw text and the
    default corpus are tokenized with ``tokenizer`` (a transformers tokenizer), once, into the cache.
    """
    from ..data import TokenDataset, corpus_in_vocabulary, looks_prepared

    if source is not None and not Path(source).exists():
        raise FileNotFoundError(f"--calib-data {source} does not exist")
    if source is not None and looks_prepared(Path(source)):
        data_dir = Path(source)
    else:
        if tokenizer is None:
            raise ValueError("calibration text must be tokenized with the model's tokenizer, and the source has none; "
                             "pass --calib-data as a prepared data dir in the model's vocabulary")
        with tempfile.TemporaryDirectory() as tmp:
            tokenizer.save_pretrained(tmp)
            tok_json = Path(tmp) / "tokenizer.json"
            if not tok_json.exists():
                raise ValueError("the model's tokenizer has no tokenizer.json form; pass --calib-data as a prepared "
                                 "data dir in the model's vocabulary")
            data_dir = corpus_in_vocabulary(tok_json, None if source is None else [Path(source)], progress)
    ds = TokenDataset.open(data_dir, "train")
    if ds.vocab_size > vocab_size:
        raise ValueError(f"calibration data {data_dir} has vocab_size {ds.vocab_size}, more than the model's {vocab_size}")
    return ds.tokens


def calibrated_model(dense: StemLM, target: ModelConfig, tokens: np.ndarray, calib: CalibrationConfig, work_dir: Path,
                     progress: bool = True, log: Callable[[str], None] = lambda s: None) -> StemLM:
    """The STEM model of ``target`` with calibrated tables (memory-mapped from ``work_dir``)."""
    ids = calibration_windows(tokens, calib.tokens, calib.seq_len)
    log(f"calibrating {len(target.table_layers)} {target.ffn} layers on {ids.numel():,} tokens "
        f"({ids.unique().numel():,} distinct ids of {target.vocab_size:,}); work dir {work_dir}")
    device = calib.torch_device()
    if device.type != "cpu":
        log(f"calibrating on {device}")
    try:
        fitted = calibrate(dense.to(device), target, ids, calib, work_dir, progress=progress, log=log)
    finally:
        dense.cpu()
    return assemble(dense, target, fitted, mmap=True)


def work_dir_for(out: Path) -> Path:
    """Where the calibration of ``out`` keeps its tables and resumable state."""
    return out.with_name(out.name + ".calibrating")


def finish(work_dir: Path) -> None:
    """Remove the work directory once the checkpoint is written."""
    shutil.rmtree(work_dir, ignore_errors=True)
