"""Put a model's STEM tables where a ``Placement`` says: ``device``, ``host`` or ``disk``.

* ``open_model(checkpoint, placement)`` loads a checkpoint with its tables going straight to the
  tier: for ``disk`` they are served from the checkpoint's own ``model.safetensors`` (keys
  ``model.tables.<layer>.weight``) without a copy and never enter RAM as a whole. Every command
  opens its model here.
* ``offload_tables(model, placement)`` moves the tables of a built model (from whatever tier they
  are on) into a new container installed as ``model.tables`` and returns it: a ``TableStore``
  for ``host``/``disk`` (prefetch, stats, flush, close), ``Tables`` for ``device``.

Disk tier and writes: a checkpoint is served read-only. ``writable=True`` maps it copy-on-write
(edits live in this process's memory, the file is untouched; save with ``save_model``). To train
or edit *on disk*, give a separate tables file: ``offload_tables(model, Placement("disk",
tables_file=P))`` writes the tables there and maps it shared (``r+``), and ``open_model(ckpt,
Placement("disk", tables_file=P, writable=True))`` writes through to ``P`` (create it with
``export_tables``).

Quantized tables (``table_dtype`` bf16 / int8 / int4, ``stemlm.model.quant``): a checkpoint or tables
file names its codec in its safetensors metadata; every tier serves what is stored, and
``table_dtype=`` re-encodes the rows for the host and device tiers (the disk tier serves a file as
it is: write a re-encoded one with ``export_tables(..., table_dtype=...)`` first).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn

from ..checkpoint.directory import WEIGHTS_FILE, load_in_memory, load_state_into, read_config, resolve_checkpoint
from ..checkpoint.integrity import verify_checkpoint
from ..model.decoder import StemLM
from ..model.quant import RowCodec, codec_of, parse_codec
from ..model.tables import Tables
from .cache import HotRowCache
from .placement import Placement, placement_of
from ..checkpoint.safetensors_io import read_metadata
from .table import TableStore
from .tiers import tier_of


# -- installing -----------------------------------------------------------------------------
def _compute_place(model: nn.Module, device, dtype):
    ref = next((p for p in model.parameters()), None)
    device = torch.device(device) if device is not None else (ref.device if ref is not None else torch.device("cpu"))
    return device, dtype or (ref.dtype if ref is not None else torch.float32)


def _cache_capacity(cache_rows: int, cache_bytes: int | None, dim: int, dtype: torch.dtype) -> int:
    if cache_bytes:
        return int(cache_bytes) // (dim * torch.empty((), dtype=dtype).element_size())
    return int(cache_rows or 0)


def _load_counts(warm_counts):
    if warm_counts is None or isinstance(warm_counts, (np.ndarray, torch.Tensor, list)):
        return warm_counts
    return np.load(Path(warm_counts))


def _counts_for(counts, num_rows: int, vocab_size: int):
    """Warm-start ``counts`` for a table of ``num_rows`` rows: token counts (``vocab_size`` entries) warm
    the token rows ``0..V-1`` of an n-gram table (``stemlm.ffn.ngram``), its hashed slots start cold."""
    if len(counts) == vocab_size < num_rows:
        counts = np.concatenate([np.asarray(counts), np.zeros(num_rows - vocab_size, dtype=np.int64)])
    return counts


def _install(model: nn.Module, p: Placement, backends: dict, device, dtype, path=None) -> Tables:
    """Install a new ``model.tables`` over ``backends`` (``StemTable``s for ``device``), closing the old one."""
    old = model.tables
    sparse = {k: t.sparse_grad for k, t in old.items()}
    old.close()
    if tier_of(p.tier).in_memory:
        tables = Tables(backends)
    else:
        caches = {}
        for name, backend in backends.items():
            capacity = _cache_capacity(p.cache_rows, p.cache_bytes, backend.shape[1], dtype)
            caches[name] = HotRowCache(*backend.shape, capacity, device, dtype, p.decay_every, p.cache_window) \
                if capacity > 0 else None
        tables = TableStore(p.tier, backends, caches, device, dtype, p.prefetch, path)
        counts = _load_counts(p.warm_counts)
        for table in tables.values():
            if table.cache is not None and counts is not None:
                table.warm(_counts_for(counts, table.num_rows, model.cfg.vocab_size))
    for name, table in tables.items():
        table.sparse_grad = sparse.get(name, False)
    model.tables = tables
    return tables


def offload_tables(model: StemLM, placement: Placement | str, overwrite: bool = False) -> Tables:
    """Move ``model.tables`` to ``placement``; returns the new ``model.tables`` (a ``TableStore`` off the device).

    A tier name stands for its default ``Placement``. The ``disk`` tier writes the tables into
    ``placement.tables_file`` (``overwrite`` replaces an existing one) and maps it read-write.
    ``device``/``dtype`` default to those of the model's parameters; ``table_dtype`` to the codec
    the tables have now.
    """
    p = placement_of(placement)
    device, dtype = _compute_place(model, p.device, p.dtype)
    codec = parse_codec(p.table_dtype) or codec_of(model.tables)
    tier = tier_of(p.tier)
    backends = tier.from_tables(model.tables, codec, p, device, dtype, overwrite)
    return _install(model, p, backends, device, dtype, Path(p.tables_file) if tier.serves_file else None)


def _skeleton(ckpt: Path, device, dtype) -> StemLM:
    """The model of a checkpoint with every weight but the tables loaded; ``model.tables`` empty.

    Built on the meta device, so the tables are never allocated (``load_in_memory(skip_tables=True)``
    would allocate and initialise them first); falls back to that if the model has buffers that
    are not stored in the checkpoint.
    """
    cfg = read_config(ckpt)
    with torch.device("meta"):
        model = StemLM(cfg)
    if any(m._non_persistent_buffers_set for m in model.modules()):
        model = load_in_memory(ckpt, skip_tables=True, verify=False)  # the caller verified it
        model.tables = Tables()
    else:
        model.tables = Tables()
        model.to_empty(device="cpu")
        if cfg.tie_embeddings:
            model.lm_head.weight = model.tok_embeddings.weight
        load_state_into(model, ckpt / WEIGHTS_FILE, skip_tables=True)
        model.eval()
    return model.to(device=device, dtype=dtype) if dtype else model.to(device)


def open_model(checkpoint: str | os.PathLike, placement: Placement | str | None = None,
               verify: bool = True) -> StemLM:
    """The model of a checkpoint (or of a run's newest one) with its tables placed, in eval mode.

    ``model.tables`` is the handle of the tier (``prefetch``, ``stats``, ``flush``, ``close``; a
    context manager). Tables come from ``placement.tables_file`` if given (see ``export_tables``),
    else from the checkpoint's ``model.safetensors``. ``verify`` checks the checkpoint against its
    checksum manifest first; NaN/inf weights are refused on every tier (``CheckpointError``).
    """
    p = placement_of(placement)
    tier = tier_of(p.tier)
    device = torch.device(p.device or "cpu")
    if tier.in_memory and p.table_dtype is None and p.tables_file is None:  # in memory, as stored
        return load_in_memory(checkpoint, device=device, dtype=p.dtype, verify=verify)
    ckpt = resolve_checkpoint(checkpoint, verify)
    if verify:
        verify_checkpoint(ckpt)
    cfg = read_config(ckpt)
    src = Path(p.tables_file) if p.tables_file is not None else ckpt / WEIGHTS_FILE
    stored = RowCodec.from_metadata(read_metadata(src)) if cfg.table_layers else RowCodec()
    codec = parse_codec(p.table_dtype) or stored
    model = _skeleton(ckpt, device, p.dtype)
    dtype = p.dtype or torch.float32
    backends = tier.from_file(src, cfg, stored, codec, p, device, dtype)
    _install(model, p, backends, device, dtype, src if tier.serves_file else None)
    return model.eval()
