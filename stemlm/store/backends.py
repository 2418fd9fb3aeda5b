"""Where the rows of an off-device table live: host RAM or a memory-mapped file.

A backend is a ``(num_rows, dim)`` CPU tensor plus ``gather``/``scatter``; the table object in
``table.py`` adds deduplication, caching, prefetch and the autograd protocol on top.

* ``HostRows``: a CPU tensor, pinned when the compute device is CUDA (so host -> device copies
  can run asynchronously on a side stream).
* ``DiskRows``: one tensor of a safetensors file. ``mode="r"`` never writes the file (a
  checkpoint's own ``model.safetensors`` is served this way, without a copy) and reads the rows
  a gather needs with ``pread`` into a fresh tensor: the page cache serves repeated reads, and no
  file page is mapped into the process, so its resident set holds only the rows it copied (a
  mapped file counts its touched pages in RSS, and whole large folios of a freshly written file
  at that); ``weight`` (used to copy whole tables to another tier) is a read-only mapping.
  Writable modes memory-map the tensor: ``mode="c"`` is copy-on-write (writes change
  the process's view only, edited pages become private RAM, the file stays intact);
  ``mode="r+"`` writes rows through to the file (use a separate tables file, never a checkpoint
  you want to keep unchanged).

* ``QuantRows``: a quantized table (``stemlm.model.quant.RowCodec``): its codes and scales in two such
  backends, decoded to fp32 rows on gather and encoded on scatter.

Backends are context managers; ``close()`` releases a disk backend's descriptors and mapping, and
a backend that is garbage-collected unclosed (its model dropped) closes its descriptors then.
"""

from __future__ import annotations

import os
import weakref
from pathlib import Path

import torch

from ..checkpoint.safetensors_io import TableFileError, map_tensor, tensor_info

DISK_MODES = ("r", "c", "r+")


class HostRows:
    """Rows in a CPU tensor (shares storage with ``weight`` when no copy is needed)."""

    reads_ahead = False  # advise() does nothing: RAM needs no read-ahead

    def __init__(self, weight: torch.Tensor, pin: bool = False):
        weight = weight.detach().to("cpu")
        self.weight = weight.pin_memory() if pin else weight
        self.writable = True

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.weight.shape)

    @property
    def dtype(self) -> torch.dtype:
        return self.weight.dtype

    @property
    def row_bytes(self) -> int:
        """Stored bytes of one row (what a gather moves per row)."""
        return self.weight.shape[1] * self.weight.element_size()

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """The stored tensors under their state-dict suffix (the backing tensors, not copies)."""
        return {"weight": self.weight}

    def gather(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``(len(ids), dim)`` at CPU ``ids`` (a fresh tensor)."""
        return torch.index_select(self.weight, 0, ids)

    def scatter(self, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """Overwrite rows at unique CPU ``ids``."""
        self.weight.index_copy_(0, ids, rows.to("cpu", self.weight.dtype))

    def advise(self, ids: torch.Tensor) -> None:
        """Hint that rows ``ids`` will be gathered soon (RAM rows need no hint)."""

    def flush(self) -> None:
        pass

    def close(self) -> None:
        """Release what the backend holds (nothing for RAM rows)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def describe(self) -> str:
        return f"host{' (pinned)' if self.weight.is_pinned() else ''}"


def _runs(ids: list[int]):
    """``(first_id, length)`` of each run of consecutive ids, in order."""
    i = 0
    while i < len(ids):
        j = i + 1
        while j < len(ids) and ids[j] == ids[j - 1] + 1:
            j += 1
        yield ids[i], j - i
        i = j


class DiskRows(HostRows):
    """One ``(num_rows, dim)`` tensor of a safetensors file: read with ``pread`` (mode ``r``) or
    memory-mapped (modes ``c``, ``r+``; see the module docstring)."""

    def __init__(self, path: str | os.PathLike, key: str, shape: tuple[int, int] | None = None, mode: str = "r"):
        if mode not in DISK_MODES:
            raise ValueError(f"disk mode must be one of {', '.join(DISK_MODES)}, got {mode!r}")
        self.path, self.key, self.mode = Path(path), key, mode
        info = tensor_info(path, key, shape)
        if len(info.shape) != 2:
            raise ValueError(f"{path}: {key!r} has shape {info.shape}; a table must be 2-D")
        self.weight, self._mm = map_tensor(path, info, mode)  # read-only unless rows are written
        self.writable = mode != "r"
        self._offset, self._row_bytes = info.offset, info.nbytes // max(1, info.shape[0])
        self._file = open(path, "rb", buffering=0) if mode == "r" and hasattr(os, "preadv") else None
        if self._file is not None and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self._file.fileno(), 0, 0, os.POSIX_FADV_RANDOM)  # no read-ahead around rows
        # advise() has its own descriptor: the page cache is shared by pread and the mapping alike
        self._hint_fd = os.open(path, os.O_RDONLY) if hasattr(os, "posix_fadvise") else None
        self.reads_ahead = self._hint_fd is not None
        self._release = weakref.finalize(self, _close_descriptors, self._file, self._hint_fd)

    def advise(self, ids: torch.Tensor) -> None:
        """Start reading rows ``ids`` (sorted, unique) into the page cache without waiting.

        One ``POSIX_FADV_WILLNEED`` per run of consecutive ids queues the reads with the device
        at once, so a later ``gather`` of rows still on disk waits for the slowest read rather than
        the sum of all (cold decode: 16 rows of 10 KB in 0.5 ms instead of 2 ms here). Rows already
        cached cost one page-cache lookup. Best effort: errors are ignored.
        """
        if self._hint_fd is None or ids.numel() == 0:
            return
        rb = self._row_bytes
        try:
            for first, n in _runs(ids.tolist()):
                os.posix_fadvise(self._hint_fd, self._offset + first * rb, n * rb, os.POSIX_FADV_WILLNEED)
        except OSError:
            pass

    def gather(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``(len(ids), dim)`` at CPU ``ids``; runs of consecutive ids are read with one ``preadv``."""
        if self._file is None:  # writable: the mapping holds the edits
            return super().gather(ids)
        out = torch.empty(tuple(ids.shape) + (self.shape[1],), dtype=self.dtype)
        if out.numel() == 0:
            return out
        buf, rb, fd = memoryview(out.view(torch.uint8).numpy()).cast("B"), self._row_bytes, self._file.fileno()
        at = 0  # rows of ``out`` filled so far
        for first, n in _runs(ids.tolist()):
            if os.preadv(fd, [buf[at * rb:(at + n) * rb]], self._offset + first * rb) != n * rb:
                raise TableFileError(f"table file {self.path} is shorter than its header says (truncated while open?)")
            at += n
        return out

    def scatter(self, ids: torch.Tensor, rows: torch.Tensor) -> None:
        if not self.writable:
            raise PermissionError(f"table {self.key!r} is served read-only from {self.path}; open the disk tier "
                                  "writable (a separate tables file, or copy-on-write) to change rows")
        super().scatter(ids, rows)

    def flush(self) -> None:
        """Push written rows to the file (``r+``); a no-op otherwise."""
        if self.mode == "r+" and self._mm is not None:
            self._mm.flush()

    def close(self) -> None:
        """Flush, close the descriptors and drop the mapping (idempotent; the rows are unusable afterwards)."""
        if not self._release.alive:
            return
        self.flush()
        self._release()
        self.weight, self._mm, self._file, self._hint_fd = None, None, None, None
        self.reads_ahead = False

    def describe(self) -> str:
        return f"disk ({self.path.name}, mode {self.mode})"


class QuantRows:
    """A quantized table: codes and (for int8/int4) scales in two backends, rows decoded on gather.

    ``shape`` and ``dtype`` are those of the decoded rows (``(num_rows, dim)``, fp32), so a table
    sees no difference; ``row_bytes`` counts the stored bytes a gather moves.
    """

    def __init__(self, codes, scales, codec, dim: int):
        self.codes, self.scales, self.codec, self.dim = codes, scales, codec, dim
        self.reads_ahead = codes.reads_ahead

    @property
    def shape(self) -> tuple[int, int]:
        return (self.codes.shape[0], self.dim)

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32

    @property
    def writable(self) -> bool:
        return self.codes.writable

    @property
    def row_bytes(self) -> int:
        return self.codec.row_bytes(self.dim)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        out = {"weight": self.codes.weight}
        if self.scales is not None:
            out["scale"] = self.scales.weight
        return out

    def gather(self, ids: torch.Tensor) -> torch.Tensor:
        """Decoded fp32 rows ``(len(ids), dim)`` at CPU ``ids``."""
        scales = self.scales.gather(ids) if self.scales is not None else None
        return self.codec.decode(self.codes.gather(ids), scales, self.dim)

    def scatter(self, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """Encode ``rows`` and overwrite them at unique CPU ``ids``."""
        codes, scales = self.codec.encode(rows.to("cpu"))
        self.codes.scatter(ids, codes)
        if self.scales is not None:
            self.scales.scatter(ids, scales)

    def advise(self, ids: torch.Tensor) -> None:
        self.codes.advise(ids)
        if self.scales is not None:
            self.scales.advise(ids)

    def flush(self) -> None:
        self.codes.flush()
        if self.scales is not None:
            self.scales.flush()

    def close(self) -> None:
        self.codes.close()
        if self.scales is not None:
            self.scales.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def describe(self) -> str:
        return f"{self.codes.describe()} as {self.codec.label}"


def _close_descriptors(file, hint_fd: int | None) -> None:
    """Close a ``DiskRows``' reader and read-ahead descriptor (also run when it is collected unclosed)."""
    if file is not None:
        file.close()
    if hint_fd is not None:
        os.close(hint_fd)
