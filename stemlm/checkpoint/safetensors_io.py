"""Row-addressable safetensors files: parse the header ourselves and memory-map the data region.

``safetensors.safe_open(...).get_slice(key)[a:b]`` reads contiguous row *ranges* only; a table
lookup needs an arbitrary set of rows, so we parse the format directly (an 8-byte little-endian
header length, a JSON header ``{key: {"dtype", "shape", "data_offsets": [begin, end]}}``, then the
data) and ``np.memmap`` one tensor's bytes. Only the pages of rows actually gathered are read
from disk (and count toward the resident set); the rest of the file is never touched.

``write_safetensors`` streams tensors (or anything ``torch.as_tensor``-able that supports row
slicing, e.g. a memory-mapped table) into a new file chunk by chunk, atomically, so a table
bigger than RAM can be copied or created.
"""

from __future__ import annotations

import json
import math
import os
import struct
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..runtime.files import atomic_file


class TableFileError(ValueError):
    """A table file is corrupt, truncated, or does not hold the expected tensor."""


# safetensors dtype -> (numpy dtype used for the memmap, torch dtype seen by callers)
DTYPES: dict[str, tuple[np.dtype, torch.dtype]] = {
    "F32": (np.dtype("<f4"), torch.float32),
    "F16": (np.dtype("<f2"), torch.float16),
    "BF16": (np.dtype("<u2"), torch.bfloat16),  # numpy has no bfloat16: map raw uint16, view in torch
    "F64": (np.dtype("<f8"), torch.float64),
    "I8": (np.dtype("i1"), torch.int8),  # the codes of int8 tables (stemlm.model.quant)
    "U8": (np.dtype("u1"), torch.uint8),  # ... of int4 tables, two codes a byte
}
# what the writer accepts: the table dtypes plus the integer and bool dtypes a state dict may hold
TORCH_TO_ST = {**{t: name for name, (_, t) in DTYPES.items()},
               torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.bool: "BOOL"}
MAX_HEADER_BYTES = 100 << 20


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives inside a safetensors file."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    offset: int  # absolute byte offset of the tensor's first byte in the file
    nbytes: int


def read_header(path: str | os.PathLike) -> dict[str, TensorInfo]:
    """Parse and validate the header of a safetensors file (clear errors for corrupt files)."""
    return _parse(path)[0]


def read_metadata(path: str | os.PathLike) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors file (empty if none), after validating its header."""
    return _parse(path)[1]


def _parse(path: str | os.PathLike) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"table file {path} does not exist")
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise TableFileError(f"corrupt table file {path}: {size} bytes, too short for a safetensors header")
        (n,) = struct.unpack("<Q", head)
        if n > min(size - 8, MAX_HEADER_BYTES):
            raise TableFileError(f"corrupt table file {path}: header length {n} exceeds the file size {size}")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise TableFileError(f"corrupt table file {path}: header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise TableFileError(f"corrupt table file {path}: header is not a JSON object")
    data_start, out = 8 + n, {}
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = entry["dtype"], tuple(int(s) for s in entry["shape"]), entry["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise TableFileError(f"corrupt table file {path}: bad header entry for {key!r}") from None
        itemsize = DTYPES[dtype][0].itemsize if dtype in DTYPES else None
        if itemsize is not None and end - begin != math.prod(shape) * itemsize:
            raise TableFileError(f"corrupt table file {path}: {key!r} spans {end - begin} bytes, shape {shape} needs "
                                 f"{math.prod(shape) * itemsize}")
        if not 0 <= begin <= end or data_start + end > size:
            raise TableFileError(f"corrupt table file {path}: {key!r} ends at byte {data_start + end} but the file "
                                 f"has {size} bytes (truncated?)")
        out[key] = TensorInfo(key, dtype, shape, data_start + begin, end - begin)
    metadata = header.get("__metadata__") or {}
    if not isinstance(metadata, dict):
        raise TableFileError(f"corrupt table file {path}: __metadata__ is not a JSON object")
    return out, metadata


def tensor_info(path: str | os.PathLike, key: str, shape: tuple[int, ...] | None = None) -> TensorInfo:
    """The header entry of ``key``, checked against the expected ``shape`` and a supported dtype."""
    infos = read_header(path)
    if key not in infos:
        found = ", ".join(sorted(infos)[:4]) or "no tensors"
        raise TableFileError(f"table file {path} has no tensor {key!r} (found {found})")
    info = infos[key]
    if info.dtype not in DTYPES:
        raise TableFileError(f"{path}: {key!r} has dtype {info.dtype}; tables must be one of {', '.join(DTYPES)}")
    if shape is not None and info.shape != tuple(shape):
        raise TableFileError(f"{path}: {key!r} has shape {info.shape}, the model expects {tuple(shape)}")
    return info


MAP_MODES = ("r", "c", "r+")


def map_tensor(path: str | os.PathLike, info: TensorInfo, mode: str = "r") -> tuple[torch.Tensor, np.memmap]:
    """A torch tensor sharing memory with the mapped bytes of one tensor (no data is read yet).

    ``mode="r"`` maps the file read-only (the tensor must not be written: callers copy rows
    out or refuse writes themselves); ``"c"`` is a private copy-on-write mapping (writes change
    this process's view only, never the file); ``"r+"`` maps it shared, so writes reach the file.
    The file must still hold every byte of the tensor: touching a mapped page past the end of a
    file kills the process with SIGBUS, so a file truncated since its header was read is a
    ``TableFileError`` here instead.
    """
    if mode not in MAP_MODES:
        raise ValueError(f"map mode must be one of {', '.join(MAP_MODES)}, got {mode!r}")
    size = os.path.getsize(path)
    if info.offset + info.nbytes > size:
        raise TableFileError(f"table file {path} is truncated: {info.key!r} needs bytes up to {info.offset + info.nbytes} "
                             f"but the file has {size}")
    np_dtype, torch_dtype = DTYPES[info.dtype]
    mm = np.memmap(path, dtype=np_dtype, mode=mode, offset=info.offset, shape=info.shape)
    _advise_random(mm)
    with warnings.catch_warnings():  # a read-only mapping: torch warns that it cannot enforce that
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        tensor = torch.from_numpy(mm)
    return (tensor.view(torch_dtype) if tensor.dtype != torch_dtype else tensor), mm


def _advise_random(mm: np.memmap) -> None:
    """Row gathers are random access: ask the kernel not to read ahead (best effort)."""
    mmap_obj = getattr(mm, "_mmap", None)
    advice = getattr(__import__("mmap"), "MADV_RANDOM", None)
    if mmap_obj is not None and advice is not None:
        try:
            mmap_obj.madvise(advice)
        except (OSError, ValueError):
            pass


# -- writing ------------------------------------------------------------------------------
RowSource = Callable[[int, int], torch.Tensor]  # (start_row, end_row) -> rows


def write_safetensors(path: str | os.PathLike, specs: Iterable[tuple[str, torch.dtype, tuple[int, ...], RowSource]],
                      metadata: dict[str, str] | None = None, chunk_bytes: int = 64 << 20,
                      progress: Callable[[int], None] | None = None) -> Path:
    """Stream tensors into a new safetensors file (atomically: a temp file renamed at the end).

    Each spec is ``(key, dtype, shape, rows_fn)``; ``rows_fn(a, b)`` returns rows ``a:b`` of the
    tensor (any dtype, converted here), so sources larger than RAM are copied ``chunk_bytes`` at
    a time. ``progress(nbytes)`` is called after each chunk. Tensors are laid out in key order.
    """
    path = Path(path)
    specs = sorted(specs, key=lambda s: s[0])
    header, offset = {}, 0
    for key, dtype, shape, _ in specs:
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        header[key] = {"dtype": TORCH_TO_ST[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    if metadata:
        header["__metadata__"] = metadata
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the format pads the header to an 8-byte boundary
    with atomic_file(path) as tmp, open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for key, dtype, shape, rows_fn in specs:
            _write_rows(f, dtype, shape, rows_fn, chunk_bytes, progress)
    return path


def _write_rows(f, dtype: torch.dtype, shape: tuple[int, ...], rows_fn: RowSource, chunk_bytes: int, progress) -> None:
    if not shape:
        raise ValueError("write_safetensors streams tensors by rows: shapes must have at least one dimension")
    n_rows = shape[0]
    row_bytes = max(1, math.prod(shape[1:]) * torch.empty((), dtype=dtype).element_size())
    step = max(1, chunk_bytes // row_bytes)
    for a in range(0, n_rows, step):
        b = min(n_rows, a + step)
        rows = torch.as_tensor(rows_fn(a, b)).detach().to("cpu", dtype).contiguous()
        if tuple(rows.shape) != (b - a, *shape[1:]):
            raise ValueError(f"row source returned shape {tuple(rows.shape)} for rows {a}:{b} of a {shape} tensor")
        if rows.numel():
            f.write(memoryview(rows.view(torch.uint8).numpy()))  # raw bytes, no extra copy
        if progress:
            progress(rows.numel() * rows.element_size())
