"""Quantized STEM tables: rows stored as bf16, int8 or int4 and dequantized when gathered.

A ``RowCodec`` turns fp32 rows ``(n, dim)`` into stored tensors and back:

* ``fp32``: the rows themselves (no codec at work).
* ``bf16``: the rows rounded to bfloat16 (half the bytes).
* ``int8``: one fp32 absmax scale per group of ``group_size`` (64) values, codes in [-127, 127]
  (``dim + 4 * ceil(dim / 64)`` bytes a row, the last group zero-padded). ``group_size=0`` is one scale
  per row (``dim + 4`` bytes), what int8 files written before 2026-11-28 hold (they carry no group size
  in their metadata and still load as such). One scale per row lets a single outlier column set every
  row's step: SmolLM2-135M's calibrated tables have one column ~30× the rows' RMS, and per-row int8 cost
  them +10.6 % perplexity where groups of 64 cost ~0 (docs/quantization.md).
* ``int4``: one fp32 absmax scale per group of ``group_size`` (32) values, codes in [-7, 7] packed two
  to a byte (``dim / 2 + 4 * ceil(dim / group_size)`` bytes a row; the last group is zero-padded).

Stored tensors keep the table's key for the codes (``tables.<layer>.weight``, int8 / uint8 /
bf16) and add ``tables.<layer>.scale`` (fp32, ``(n, groups)``); the codec's name is written into
the safetensors metadata (``stemlm_table_dtype``), which is what loaders read.

Encoding is a fixpoint of decoding: ``encode(decode(codes)) == codes`` bit for bit (the scale is
snapped to a value that re-encoding its own decoded row reproduces), so reading rows and writing
them back (a swap, a copy, an undo) never drifts, whatever the tier.

``QuantizedTable`` is the device tier of a quantized table (codes and scales as buffers, not
trainable); ``quantize_tables(model, "int8")`` is the transform that installs them from outside the
model, as torchao's ``quantize_`` does. Host and disk tiers wrap their backends in
``store.backends.QuantRows``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn

from .tables import TableLookup, Tables, check_ids

TABLE_DTYPES = ("fp32", "bf16", "int8", "int4")
DEFAULT_GROUP_SIZE = 32  # int4
DEFAULT_GROUP_SIZES = {"int8": 64, "int4": DEFAULT_GROUP_SIZE}
METADATA_DTYPE, METADATA_GROUP = "stemlm_table_dtype", "stemlm_table_group_size"


@dataclass(frozen=True)
class RowCodec:
    """How a table's rows are stored: ``name`` in ``TABLE_DTYPES``; ``group_size`` for ``int8`` (default 64;
    0: one scale per row) and ``int4`` (default 32)."""

    name: str = "fp32"
    group_size: int | None = None  # None: the name's default (DEFAULT_GROUP_SIZES)

    def __post_init__(self):
        if self.name not in TABLE_DTYPES:
            raise ValueError(f"unknown table dtype {self.name!r}; choose one of {', '.join(TABLE_DTYPES)}")
        if self.group_size is None:
            object.__setattr__(self, "group_size", DEFAULT_GROUP_SIZES.get(self.name, DEFAULT_GROUP_SIZE))
        if self.name == "int4" and (self.group_size < 2 or self.group_size % 2):
            raise ValueError(f"int4 group size must be an even number >= 2, got {self.group_size}")
        if self.name == "int8" and self.group_size < 0:
            raise ValueError(f"int8 group size must be >= 1 (or 0: one scale per row), got {self.group_size}")

    @property
    def grouped(self) -> bool:
        """Whether scales are per group of ``group_size`` values (else one per row)."""
        return self.name == "int4" or (self.name == "int8" and self.group_size > 0)

    @property
    def label(self) -> str:
        """The codec in words: ``int8`` (groups of 64), ``int8 (one scale per row)``, ..."""
        if not self.grouped:
            return "int8 (one scale per row)" if self.name == "int8" else self.name
        if self.group_size == DEFAULT_GROUP_SIZES[self.name]:
            return self.name
        return f"{self.name} (groups of {self.group_size})"

    @property
    def quantized(self) -> bool:
        """True unless rows are stored as plain fp32."""
        return self.name != "fp32"

    @property
    def has_scale(self) -> bool:
        return self.name in ("int8", "int4")

    @property
    def code_dtype(self) -> torch.dtype:
        return {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.int8, "int4": torch.uint8}[self.name]

    def groups(self, dim: int) -> int:
        """Scales per row."""
        return math.ceil(dim / self.group_size) if self.grouped else 1

    def code_shape(self, n: int, dim: int) -> tuple[int, int]:
        if self.name == "int4":
            return (n, self.groups(dim) * self.group_size // 2)
        return (n, self.groups(dim) * self.group_size) if self.grouped else (n, dim)

    def scale_shape(self, n: int, dim: int) -> tuple[int, int]:
        return (n, self.groups(dim))

    def row_bytes(self, dim: int) -> int:
        """Bytes one stored row takes (codes and scales)."""
        codes = self.code_shape(1, dim)[1] * torch.empty((), dtype=self.code_dtype).element_size()
        return codes + (4 * self.groups(dim) if self.has_scale else 0)

    def metadata(self) -> dict[str, str]:
        """The safetensors metadata entries naming this codec (none for fp32)."""
        if not self.quantized:
            return {}
        out = {METADATA_DTYPE: self.name}
        if self.name in ("int8", "int4"):
            out[METADATA_GROUP] = str(self.group_size)
        return out

    @classmethod
    def from_metadata(cls, metadata: dict | None) -> "RowCodec":
        metadata = metadata or {}
        name = metadata.get(METADATA_DTYPE, "fp32")
        group = metadata.get(METADATA_GROUP)
        if group is None and name == "int8":  # written before int8 had groups: one scale per row
            group = 0
        try:
            return cls(name, None if group is None else int(group))  # None: the name's default
        except ValueError as e:
            raise ValueError(f"table metadata: {e}") from None  # names the bad value

    # -- encoding ---------------------------------------------------------------------------
    def encode(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """fp32 rows ``(n, dim)`` -> ``(codes, scales or None)``; NaN/inf rows are refused."""
        rows = rows.detach().float()
        if self.name == "fp32":
            return rows, None
        if self.name == "bf16":
            return rows.to(torch.bfloat16), None
        if not bool(torch.isfinite(rows).all()):
            raise ValueError("cannot quantize table rows holding NaN/inf")
        n, dim = rows.shape
        if self.name == "int8" and not self.grouped:
            scale = _snapped_scale(rows.abs().amax(dim=1, keepdim=True), 127.0)  # (n, 1)
            return torch.round(rows / scale).clamp_(-127, 127).to(torch.int8), scale
        g = self.groups(dim)
        padded = torch.zeros(n, g * self.group_size, dtype=torch.float32, device=rows.device)
        padded[:, :dim] = rows
        grouped = padded.view(n, g, self.group_size)  # (n, G, group)
        if self.name == "int8":
            scale = _snapped_scale(grouped.abs().amax(dim=2), 127.0)  # (n, G)
            q = torch.round(grouped / scale.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)
            return q.view(n, -1), scale
        scale = _snapped_scale(grouped.abs().amax(dim=2), 7.0)  # (n, G)
        q = torch.round(grouped / scale.unsqueeze(-1)).clamp_(-7, 7).to(torch.uint8).add_(8)  # 1..15; 8 is zero
        pairs = q.view(n, -1, 2)  # (n, G*group/2, 2)
        return pairs[..., 0] | (pairs[..., 1] << 4), scale

    def decode(self, codes: torch.Tensor, scale: torch.Tensor | None, dim: int) -> torch.Tensor:
        """Stored ``(codes, scales)`` -> fp32 rows ``(n, dim)``."""
        if self.name in ("fp32", "bf16"):
            return codes.float()
        n = codes.shape[0]
        if self.name == "int8":
            if not self.grouped:
                return codes.float() * scale
            return (codes.float().view(n, -1, self.group_size) * scale.unsqueeze(-1)).view(n, -1)[:, :dim]
        q = torch.stack((codes & 0xF, codes >> 4), dim=-1).view(n, -1, self.group_size)  # (n, G, group)
        rows = (q.float() - 8.0) * scale.unsqueeze(-1)
        return rows.view(n, -1)[:, :dim]


def _snapped_scale(absmax: torch.Tensor, qmax: float) -> torch.Tensor:
    """``absmax / qmax`` snapped to the fixpoint of ``s -> (s * qmax) / qmax`` (1 for an all-zero group).

    Re-encoding a decoded row finds ``absmax' = s * qmax`` and so the scale ``(s * qmax) / qmax``;
    that map is idempotent after one application in fp32, so snapping once makes decode -> encode
    reproduce the scale (and therefore the codes) bit for bit.
    """
    s = torch.where(absmax > 0, absmax / qmax, torch.ones_like(absmax))
    return (s * qmax) / qmax


def parse_codec(table_dtype: str | RowCodec | None, group_size: int | None = None) -> RowCodec | None:
    """A ``RowCodec`` from a name (``None`` stays ``None``: keep what is stored)."""
    if table_dtype is None or isinstance(table_dtype, RowCodec):
        return table_dtype
    return RowCodec(table_dtype, group_size)


def codec_of(tables) -> RowCodec:
    """The codec of a model's tables (``model.tables``, any tier); fp32 for a dense model."""
    codecs = {getattr(t, "codec", None) or getattr(getattr(t, "backend", None), "codec", None) or RowCodec()
              for t in tables.values()}
    if len(codecs) > 1:
        raise ValueError(f"the tables of one model use different codecs: {sorted(c.name for c in codecs)}")
    return codecs.pop() if codecs else RowCodec()


def encode_chunks(rows_fn, num_rows: int, dim: int, codec: RowCodec, chunk_bytes: int = 64 << 20):
    """``(codes, scales)`` of a whole table read ``rows_fn(a, b)`` a chunk at a time (CPU tensors)."""
    codes = torch.empty(codec.code_shape(num_rows, dim), dtype=codec.code_dtype)
    scales = torch.empty(codec.scale_shape(num_rows, dim)) if codec.has_scale else None
    step = max(1, chunk_bytes // max(1, 4 * dim))
    for a in range(0, num_rows, step):
        b = min(num_rows, a + step)
        c, s = codec.encode(torch.as_tensor(rows_fn(a, b)).to("cpu"))
        codes[a:b] = c
        if scales is not None:
            scales[a:b] = s
    return codes, scales


class QuantizedTable(TableLookup, nn.Module):
    """A table stored with a ``RowCodec`` in the model's memory (the quantized ``device`` tier).

    Buffers ``weight`` (codes) and ``scale`` (absent for bf16) are dequantized to fp32 rows on
    gather. Inference only: the codes are not parameters, and ``sparse_grad`` cannot be turned on.
    A dtype cast of the model (``model.to(torch.bfloat16)``) leaves the encoding as it is.
    """

    def __init__(self, num_rows: int, dim: int, codec: RowCodec):
        super().__init__()
        if not codec.quantized:
            raise ValueError("QuantizedTable needs a quantizing codec (bf16, int8, int4); fp32 is a StemTable")
        self.num_rows, self.dim, self.codec = num_rows, dim, codec
        self.register_buffer("weight", torch.zeros(codec.code_shape(num_rows, dim), dtype=codec.code_dtype))
        if codec.has_scale:
            self.register_buffer("scale", torch.ones(codec.scale_shape(num_rows, dim)))
        else:
            self.scale = None

    @property
    def sparse_grad(self) -> bool:
        return False

    @sparse_grad.setter
    def sparse_grad(self, value: bool) -> None:
        if value:
            raise ValueError(f"{self.codec.name} tables are for inference; train from the fp32 checkpoint")

    def _decode(self, ids: torch.Tensor) -> torch.Tensor:
        scale = self.scale.index_select(0, ids) if self.scale is not None else None
        return self.codec.decode(self.weight.index_select(0, ids), scale, self.dim)

    def gather(self, uniq: torch.Tensor) -> torch.Tensor:
        """fp32 rows ``(U, dim)`` for unique ids."""
        return self._decode(uniq.to(self.weight.device))

    def read_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Decoded rows at ``ids`` (any shape) -> ``ids.shape + (dim,)``."""
        ids = torch.as_tensor(ids, dtype=torch.long)
        check_ids(ids, self.num_rows)
        return self._decode(ids.reshape(-1).to(self.weight.device)).view(*ids.shape, self.dim)

    @torch.no_grad()
    def write_rows(self, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """Encode ``rows`` and store them at ``ids`` (the last write wins for a repeated id)."""
        ids = torch.as_tensor(ids, dtype=torch.long).reshape(-1).to(self.weight.device)
        check_ids(ids, self.num_rows)
        codes, scale = self.codec.encode(rows.reshape(len(ids), self.dim).to(self.weight.device))
        self.weight[ids] = codes
        if scale is not None:
            self.scale[ids] = scale

    def _apply(self, fn, recurse=True):
        device = fn(torch.empty(0, dtype=torch.uint8, device=self.weight.device)).device
        for name, buf in self._buffers.items():
            if buf is not None:
                self._buffers[name] = buf.to(device)
        return self

    def extra_repr(self) -> str:
        return f"{self.num_rows}, {self.dim}, {self.codec.name}"


def quantized_tables(rows_of: dict, dim: int, codec: RowCodec) -> Tables:
    """Empty (zero-code) ``QuantizedTable``s for the layers of ``rows_of`` (layer -> rows), to load a checkpoint into."""
    return Tables({str(k): QuantizedTable(n, dim, codec) for k, n in rows_of.items()})


def quantize_tables(model: nn.Module, table_dtype: str | RowCodec, group_size: int | None = None) -> Tables:
    """Re-encode the model's tables on the device tier with ``table_dtype`` (``group_size``: int8's or int4's
    values per scale, default 64 / 32); returns the new ``model.tables``.

    ``fp32`` turns quantized tables back into ``StemTable``s (their decoded rows). Tables on the host
    or disk tier are re-encoded with ``store.offload_tables(model, Placement(tier, table_dtype=...))`` instead.
    """
    from .tables import StemTable

    codec = parse_codec(table_dtype, group_size)
    old = model.tables
    if old.tier != "device":
        raise ValueError(f"quantize_tables works on tables in the model's memory; these are on the {old.tier} tier "
                         "(use store.offload_tables(model, Placement(tier, table_dtype=...)))")
    new = Tables()
    for key, table in old.items():
        if not codec.quantized:
            new[key] = StemTable(table.num_rows, table.dim)
            new[key].weight.data = table.read_rows(torch.arange(table.num_rows)).float().clone()
            continue
        device = next((b.device for b in table.buffers()), None) or next(table.parameters()).device
        new[key] = QuantizedTable(table.num_rows, table.dim, codec).to(device)
        codes, scale = encode_chunks(lambda a, b, t=table: t.read_rows(torch.arange(a, b)), table.num_rows, table.dim,
                                     codec)
        new[key].weight.copy_(codes)
        if scale is not None:
            new[key].scale.copy_(scale)
    model.tables = new
    return new
