"""The tiers a table can live on, each one class that builds what serves its rows; the one place a tier is named.

``device`` (``StemTable``s in the model's memory, or ``QuantizedTable``s), ``host`` (rows in CPU RAM,
``HostRows``) and ``disk`` (rows in a safetensors file, ``DiskRows``). Each ``Tier`` builds one
backend per table layer in two situations, and ``offload.py`` only installs what it gets:

* ``from_file``: a checkpoint's (or a tables file's) stored tables, read layer by layer (``open_model``);
* ``from_tables``: the tables of a built model, on whatever tier they are now (``offload_tables``).

A new tier is a backend (``backends.py``) and a class here with its line in ``TIER_CLASSES``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import ClassVar

import torch
import torch.nn as nn

from ..checkpoint.directory import KEY_PREFIX, WEIGHTS_FILE, read_config, resolve_checkpoint, stored_codec
from ..checkpoint.integrity import check_finite
from ..model.quant import QuantizedTable, RowCodec, codec_of, encode_chunks, parse_codec
from ..model.tables import StemTable
from .backends import DiskRows, HostRows, QuantRows
from ..checkpoint.safetensors_io import write_safetensors
from .table import OffloadedTable


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


# -- sources ------------------------------------------------------------------------------------
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
    if isinstance(model_or_ckpt, nn.Module):
        tables = model_or_ckpt.tables
        sources = {k: ((t.num_rows, t.dim), _row_source(t)) for k, t in tables.items()}
        return _write_tables(sources, path, parse_codec(table_dtype) or codec_of(tables), overwrite)
    ckpt = resolve_checkpoint(model_or_ckpt)
    cfg = read_config(ckpt)
    src_codec = stored_codec(ckpt / WEIGHTS_FILE)
    disk = {str(i): disk_backend(ckpt / WEIGHTS_FILE, i, (cfg.table_rows(i), cfg.d_ff), src_codec) for i in cfg.table_layers}
    sources = {k: (d.shape, (None, lambda a, b, d=d: d.gather(torch.arange(a, b)))) for k, d in disk.items()}
    return _write_tables(sources, path, parse_codec(table_dtype) or src_codec, overwrite)


def _write_tables(sources: dict, path: str | os.PathLike, codec: RowCodec, overwrite: bool) -> Path:
    """A tables file of ``sources`` (layer key -> ``(shape, (full tensor or None, rows_fn))``) stored as ``codec``."""
    path = Path(path)
    if path.exists() and not overwrite:
        raise FileExistsError(f"tables file {path} exists; pass overwrite=True to replace it")
    specs = []
    for k, (shape, (full, fn)) in sources.items():
        specs += _encoded_specs(k, shape, fn, codec, full.dtype if full is not None else torch.float32)
    return write_safetensors(path, specs, metadata={"format": "pt", "content": "stemlm tables", **codec.metadata()})


# -- the tiers ----------------------------------------------------------------------------------
def _check_finite_rows(rows, key: str, src: Path, chunk_bytes: int = 64 << 20) -> None:
    """``CheckpointError`` if a stored table holds NaN/inf (read in chunks: a disk table never enters RAM whole)."""
    step = max(1, chunk_bytes // max(1, rows.row_bytes))
    for a in range(0, rows.shape[0], step):
        ids = torch.arange(a, min(a + step, rows.shape[0]))
        check_finite([(key, rows.gather(ids))], str(src), "refusing to load a diverged model; use an earlier checkpoint")


def _stored_layers(src: Path, cfg, stored: RowCodec):
    """``(layer, reader)`` of every table stored in ``src``, its rows checked finite first (read with
    ``pread``: checked rows never stay resident)."""
    for i in cfg.table_layers:
        with disk_backend(src, i, (cfg.table_rows(i), cfg.d_ff), stored, mode="r") as reader:
            _check_finite_rows(reader, table_key(i), src)
            yield i, reader


def _pin(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_available()


class Tier:
    """How one tier builds the backends of a model's tables (see the module docstring)."""

    name: ClassVar[str]
    in_memory: ClassVar[bool] = False  # the tables are the model's own parameters (no TableStore)
    serves_file: ClassVar[bool] = False  # rows are read from the tables file itself (the store names it)

    def from_file(self, src: Path, cfg, stored: RowCodec, codec: RowCodec, placement, device, dtype) -> dict:
        """Layer key -> backend for the tables stored in ``src`` with ``stored``, to serve as ``codec``."""
        backends = {}
        for i, reader in _stored_layers(src, cfg, stored):
            rows_fn = lambda a, b, d=reader: d.gather(torch.arange(a, b))  # noqa: E731  (decoded fp32 rows)
            backends[str(i)] = self.from_rows(rows_fn, (cfg.table_rows(i), cfg.d_ff), codec, device, dtype)
        return backends

    def from_tables(self, tables, codec: RowCodec, placement, device, dtype, overwrite: bool = False) -> dict:
        """Layer key -> backend for the live ``tables`` of a model."""
        return {k: self.from_rows(_row_source(t)[1], (t.num_rows, t.dim), codec, device, dtype) for k, t in tables.items()}

    def from_rows(self, rows_fn, shape: tuple[int, int], codec: RowCodec, device, dtype):
        raise NotImplementedError


class DeviceTier(Tier):
    """Rows in the model's memory: a ``StemTable`` (a parameter) or a ``QuantizedTable``."""

    name = "device"
    in_memory = True

    def from_rows(self, rows_fn, shape, codec, device, dtype):
        return device_table(rows_fn, shape, codec, device, dtype)


class HostTier(Tier):
    """Rows in CPU RAM (pinned when the compute device is CUDA), served through a ``TableStore``."""

    name = "host"

    def from_file(self, src, cfg, stored, codec, placement, device, dtype):
        if codec != stored:
            return super().from_file(src, cfg, stored, codec, placement, device, dtype)
        backends = {}
        for i, reader in _stored_layers(src, cfg, stored):  # the stored tensors, copied as they are
            copy = {name: HostRows(t.clone(), pin=_pin(device)) for name, t in reader.state_tensors().items()}
            backends[str(i)] = QuantRows(copy["weight"], copy.get("scale"), codec, cfg.d_ff) if codec.quantized \
                else copy["weight"]
        return backends

    def from_tables(self, tables, codec, placement, device, dtype, overwrite=False):
        backends = {}
        for k, t in tables.items():
            shape, (full, fn) = (t.num_rows, t.dim), _row_source(t)
            if full is not None:
                rows = full.detach().to("cpu")
                on_disk = isinstance(getattr(t, "backend", None), DiskRows)
                rows = rows.clone() if on_disk and rows.data_ptr() == full.data_ptr() else rows  # leave the mmap
                fn = lambda a, b, w=rows: w[a:b]  # noqa: E731
            backends[k] = self.from_rows(fn, shape, codec, device, dtype)
        return backends

    def from_rows(self, rows_fn, shape, codec, device, dtype):
        return host_backend(rows_fn, shape, codec, _pin(device))


class DiskTier(Tier):
    """Rows in a safetensors file, read with ``pread`` or memory-mapped (``DiskRows``)."""

    name = "disk"
    serves_file = True

    def from_file(self, src, cfg, stored, codec, placement, device, dtype):
        if codec != stored:
            raise ValueError(f"{src} stores its tables as {stored.label}; the disk tier serves them as stored: write "
                             f"{codec.label} tables first (`stemlm convert --ckpt "
                             f"{src.parent if src.name == WEIGHTS_FILE else 'CKPT'} --table-dtype {codec.name} --out DIR`)")
        mode = ("r+" if placement.tables_file is not None else "c") if placement.writable else "r"
        list(_stored_layers(src, cfg, stored))  # every table checked finite before it is served
        return {str(i): disk_backend(src, i, (cfg.table_rows(i), cfg.d_ff), stored, mode=mode)
                for i in cfg.table_layers}

    def from_tables(self, tables, codec, placement, device, dtype, overwrite=False):
        if placement.tables_file is None:
            raise ValueError("the disk tier needs a tables file (Placement(\"disk\", tables_file=...)) to create")
        path = Path(placement.tables_file)
        for t in tables.values():
            if isinstance(getattr(t, "backend", None), DiskRows) and t.backend.path.resolve() == path.resolve():
                raise ValueError(f"the tables are already served from {path}; choose another path")
        _write_tables({k: ((t.num_rows, t.dim), _row_source(t)) for k, t in tables.items()}, path, codec, overwrite)
        return {k: disk_backend(path, k, (t.num_rows, t.dim), codec, mode="r+") for k, t in tables.items()}


TIER_CLASSES: dict[str, type[Tier]] = {t.name: t for t in (DeviceTier, HostTier, DiskTier)}
TIERS = tuple(TIER_CLASSES)  # the first is the model's own memory


def tier_of(name: str) -> Tier:
    """The ``Tier`` called ``name`` (a one-line ``ValueError`` naming the tiers otherwise)."""
    if name not in TIER_CLASSES:
        raise ValueError(f"unknown table tier {name!r}; choose one of {', '.join(TIERS)}")
    return TIER_CLASSES[name]()
