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

from ..interop.checkpoint import (KEY_PREFIX, WEIGHTS_FILE, load_model, load_state_into, read_config, resolve_checkpoint,
                                  stored_codec)
from ..interop.integrity import check_finite, verify_checkpoint
from ..model.decoder import StemLM
from ..model.quant import QuantizedTable, RowCodec, codec_of, encode_chunks, parse_codec
from ..model.tables import StemTable, Tables
from .backends import DiskRows, HostRows, QuantRows
from .cache import HotRowCache
from .placement import Placement, placement_of
from .safetensors_io import read_metadata, write_safetensors
from .table import OffloadedTable, TableStore


def table_key(layer: str | int, name: str = "weight") -> str:
    """The safetensors key of a layer's table (``name="scale"``: its quantization scales)."""
    return f"{KEY_PREFIX}tables.{layer}.{name}"


def disk_backend(path: Path, layer: str | int, shape: tuple[int, int], codec: RowCodec, mode: str = "r"):
    """The backend reading one layer's table from a safetensors file stored with ``codec``."""
    n, dim = shape
    if not codec.quantized:
        return DiskRows(path, table_key(layer), shape, mode=mode)
    codes = DiskRows(path, table_key(layer), codec.code_shape(n, dim), mode=mode)
    scales = DiskRows(path, table_key(layer, "scale"), codec.scale_shape(n, dim), mode=mode) if codec.has_scale else None
    return QuantRows(codes, scales, codec, dim)


def host_backend(rows_fn, shape: tuple[int, int], codec: RowCodec, pin: bool = False):
    """A host-RAM backend holding the rows ``rows_fn(a, b)`` encoded with ``codec``."""
    n, dim = shape
    if not codec.quantized:
        return HostRows(rows_fn(0, n), pin=pin)
    codes, scales = encode_chunks(rows_fn, n, dim, codec)
    return QuantRows(HostRows(codes, pin=pin), HostRows(scales, pin=pin) if scales is not None else None, codec, dim)


def device_table(rows_fn, shape: tuple[int, int], codec: RowCodec, device, dtype) -> nn.Module:
    """A table in the model's memory: a ``StemTable`` (fp32 codec, served as ``dtype``) or a ``QuantizedTable``."""
    n, dim = shape
    if not codec.quantized:
        table = StemTable(n, dim).to(device)
        table.weight.data = torch.as_tensor(rows_fn(0, n)).to(device, dtype).clone()
        return table
    table = QuantizedTable(n, dim, codec).to(device)
    codes, scales = encode_chunks(rows_fn, n, dim, codec)
    table.weight.copy_(codes)
    if scales is not None:
        table.scale.copy_(scales)
    return table


# -- sources --------------------------------------------------------------------------------
def _row_source(table: nn.Module):
    """``(full_tensor or None, rows_fn(a, b))`` for any table object (a full tensor for plain rows only)."""
    if isinstance(table, StemTable):
        w = table.weight.detach()
        return w, lambda a, b: w[a:b]
    if isinstance(table, OffloadedTable) and not isinstance(table.backend, QuantRows):
        w = table.backend.weight
        return w, lambda a, b: w[a:b]
    return None, lambda a, b: table.read_rows(torch.arange(a, b))


def _encoded_specs(layer: str, shape: tuple[int, int], rows_fn, codec: RowCodec, plain_dtype: torch.dtype) -> list:
    """``write_safetensors`` specs of one layer's table encoded with ``codec``."""
    n, dim = shape
    if not codec.quantized:
        return [(table_key(layer), plain_dtype, shape, rows_fn)]
    specs = [(table_key(layer), codec.code_dtype, codec.code_shape(n, dim), lambda a, b: codec.encode(rows_fn(a, b))[0])]
    if codec.has_scale:
        specs.append((table_key(layer, "scale"), torch.float32, codec.scale_shape(n, dim),
                      lambda a, b: codec.encode(rows_fn(a, b))[1]))
    return specs


def export_tables(model_or_ckpt, path: str | os.PathLike, table_dtype: str | RowCodec | None = None,
                  overwrite: bool = False) -> Path:
    """Write every table of a model (or of a checkpoint, streamed) into a safetensors tables file.

    ``table_dtype`` (``fp32``, ``bf16``, ``int8``, ``int4``): how the rows are stored (default: as
    the source stores them).
    """
    path = Path(path)
    if path.exists() and not overwrite:
        raise FileExistsError(f"tables file {path} exists; pass overwrite=True to replace it")
    if isinstance(model_or_ckpt, nn.Module):
        src_codec = codec_of(model_or_ckpt.tables)
        sources = {k: ((t.num_rows, t.dim), _row_source(t)) for k, t in model_or_ckpt.tables.items()}
    else:
        ckpt = resolve_checkpoint(model_or_ckpt)
        cfg = read_config(ckpt)
        src_codec = stored_codec(ckpt / WEIGHTS_FILE)
        shape = (cfg.vocab_size, cfg.d_ff)
        disk = {str(i): disk_backend(ckpt / WEIGHTS_FILE, i, shape, src_codec) for i in cfg.table_layers}
        sources = {k: (shape, (None, lambda a, b, d=d: d.gather(torch.arange(a, b)))) for k, d in disk.items()}
    codec = parse_codec(table_dtype) or src_codec
    specs = []
    for k, (shape, (full, fn)) in sources.items():
        specs += _encoded_specs(k, shape, fn, codec, full.dtype if full is not None else torch.float32)
    return write_safetensors(path, specs, metadata={"format": "pt", "content": "stemlm tables", **codec.metadata()})


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


def _install(model: nn.Module, p: Placement, backends: dict, device, dtype, path=None) -> Tables:
    """Install a new ``model.tables`` over ``backends`` (``StemTable``s for ``device``), closing the old one."""
    old = model.tables
    sparse = {k: t.sparse_grad for k, t in old.items()}
    old.close()
    if not p.off_device:
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
                table.warm(counts)
    for name, table in tables.items():
        table.sparse_grad = sparse.get(name, False)
    model.tables = tables
    return tables


def _check_finite_rows(rows, key: str, src: Path, chunk_bytes: int = 64 << 20) -> None:
    """``CheckpointError`` if a stored table holds NaN/inf (read in chunks: a disk table never enters RAM whole)."""
    step = max(1, chunk_bytes // max(1, rows.row_bytes))
    for a in range(0, rows.shape[0], step):
        ids = torch.arange(a, min(a + step, rows.shape[0]))
        check_finite([(key, rows.gather(ids))], str(src), "refusing to load a diverged model; use an earlier checkpoint")


def offload_tables(model: StemLM, placement: Placement | str, overwrite: bool = False) -> Tables:
    """Move ``model.tables`` to ``placement``; returns the new ``model.tables`` (a ``TableStore`` off the device).

    A tier name stands for its default ``Placement``. The ``disk`` tier writes the tables into
    ``placement.tables_file`` (``overwrite`` replaces an existing one) and maps it read-write.
    ``device``/``dtype`` default to those of the model's parameters; ``table_dtype`` to the codec
    the tables have now.
    """
    p = placement_of(placement)
    tier, path = p.tier, p.tables_file
    device, dtype = _compute_place(model, p.device, p.dtype)
    codec = parse_codec(p.table_dtype) or codec_of(model.tables)
    if tier == "disk":
        if path is None:
            raise ValueError("the disk tier needs a tables file (Placement(\"disk\", tables_file=...)) to create")
        path = Path(path)
        for t in model.tables.values():
            if isinstance(getattr(t, "backend", None), DiskRows) and t.backend.path.resolve() == path.resolve():
                raise ValueError(f"the tables are already served from {path}; choose another path")
        export_tables(model, path, table_dtype=codec, overwrite=overwrite)
        backends = {k: disk_backend(path, k, (t.num_rows, t.dim), codec, mode="r+") for k, t in model.tables.items()}
    else:
        backends = {}
        pin = device.type == "cuda" and torch.cuda.is_available()
        for k, t in model.tables.items():
            shape, (full, fn) = (t.num_rows, t.dim), _row_source(t)
            if full is not None and tier == "host":
                rows = full.detach().to("cpu")
                on_disk = isinstance(getattr(t, "backend", None), DiskRows)
                rows = rows.clone() if on_disk and rows.data_ptr() == full.data_ptr() else rows  # leave the mmap
                fn = lambda a, b, w=rows: w[a:b]  # noqa: E731
            backends[k] = device_table(fn, shape, codec, device, dtype) if tier == "device" \
                else host_backend(fn, shape, codec, pin)
    return _install(model, p, backends, device, dtype, path)


def _skeleton(ckpt: Path, device, dtype) -> StemLM:
    """The model of a checkpoint with every weight but the tables loaded; ``model.tables`` empty.

    Built on the meta device, so the tables are never allocated (``load_model(skip_tables=True)``
    would allocate and initialise them first); falls back to that if the model has buffers that
    are not stored in the checkpoint.
    """
    cfg = read_config(ckpt)
    with torch.device("meta"):
        model = StemLM(cfg)
    if any(m._non_persistent_buffers_set for m in model.modules()):
        model = load_model(ckpt, skip_tables=True, verify=False)  # the caller verified it
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
    device = torch.device(p.device or "cpu")
    if not p.off_device and p.table_dtype is None and p.tables_file is None:  # in memory, as stored
        return load_model(checkpoint, device=device, dtype=p.dtype, verify=verify)
    ckpt = resolve_checkpoint(checkpoint)
    if verify:
        verify_checkpoint(ckpt)
    cfg = read_config(ckpt)
    src = Path(p.tables_file) if p.tables_file is not None else ckpt / WEIGHTS_FILE
    stored = RowCodec.from_metadata(read_metadata(src)) if cfg.table_layers else RowCodec()
    codec = parse_codec(p.table_dtype) or stored
    if p.tier == "disk" and codec != stored:
        raise ValueError(f"{src} stores its tables as {stored.name}; the disk tier serves them as stored: write "
                         f"{codec.name} tables first (`stemlm convert --ckpt {ckpt} --table-dtype {codec.name} --out DIR`)")
    model = _skeleton(ckpt, device, p.dtype)
    dtype = p.dtype or torch.float32
    shape = (cfg.vocab_size, cfg.d_ff)
    mode = ("r+" if p.tables_file is not None else "c") if p.writable else "r"
    pin = device.type == "cuda" and torch.cuda.is_available()
    backends = {}
    for i in cfg.table_layers:
        with disk_backend(src, i, shape, stored, mode="r") as reader:  # pread: checked rows never stay resident
            _check_finite_rows(reader, table_key(i), src)
            if p.tier == "host" and codec == stored:  # the stored tensors, copied as they are
                copy = {name: HostRows(t.clone(), pin=pin) for name, t in reader.state_tensors().items()}
                backends[str(i)] = QuantRows(copy["weight"], copy.get("scale"), codec, cfg.d_ff) if codec.quantized \
                    else copy["weight"]
            elif p.tier != "disk":
                rows_fn = lambda a, b, d=reader: d.gather(torch.arange(a, b))  # noqa: E731  (decoded fp32 rows)
                backends[str(i)] = device_table(rows_fn, shape, codec, device, dtype) if p.tier == "device" \
                    else host_backend(rows_fn, shape, codec, pin)
        if p.tier == "disk":
            backends[str(i)] = disk_backend(src, i, shape, stored, mode=mode)
    _install(model, p, backends, device, dtype, src if p.tier == "disk" else None)
    return model.eval()
