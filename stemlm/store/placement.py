"""Where a model's STEM tables live, as one value: ``Placement``.

Every command and the Python API take the same ``Placement``: ``open_model(checkpoint, placement)``
and ``offload_tables(model, placement)`` (``offload.py``), the CLI from one set of options
(``stemlm.cli.options.add_placement_arguments``), ``AutoModelForCausalLM.from_pretrained`` from its
keyword arguments (``tables="host"``, ...)::

    model = open_model("runs/default", Placement("disk", cache_rows=512))
    model.tables.stats()     # the handle of the tier: prefetch, stats, flush, close
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch

from ..model.quant import parse_codec
from .tiers import tier_of


@dataclass(frozen=True)
class Placement:
    """Where the tables of a model live and how their rows are served.

    * ``tier``: ``device`` (the model's memory), ``host`` (CPU RAM) or ``disk`` (a safetensors file);
    * ``tables_file``: a separate tables file (``export_tables``) instead of the checkpoint's own
      ``model.safetensors``; ``writable``: the disk tier maps it writable (write-through to a tables
      file, copy-on-write for a checkpoint; default read-only);
    * ``cache_rows`` / ``cache_bytes``: a hot-row cache per table on the compute device (host and disk
      tiers), ``cache_window`` the fraction of it kept as an LRU admission window, ``warm_counts`` token
      counts (array or ``.npy`` path) to warm it, ``decay_every`` its frequency decay;
    * ``prefetch``: gather the rows of a forward on a background worker (host and disk tiers);
    * ``table_dtype``: store the rows as ``fp32``, ``bf16``, ``int8`` or ``int4`` (re-encoded at load for
      the device and host tiers; the disk tier serves its file as stored); default: as stored;
    * ``device`` / ``dtype``: where and as what the model computes and the rows are served (default:
      CPU and the stored dtype when loading, the model's own when moving a built model).
    """

    tier: str = "device"
    tables_file: str | os.PathLike | None = None
    writable: bool = False
    cache_rows: int = 0
    cache_bytes: int | None = None
    cache_window: float = 0.0
    warm_counts: object = None
    decay_every: int = 0
    prefetch: bool = True
    table_dtype: str | None = None
    device: str | torch.device | None = None
    dtype: torch.dtype | None = None

    def __post_init__(self):
        tier_of(self.tier)
        if self.tier == "device" and (self.cache_rows or self.cache_bytes):
            raise ValueError("a hot-row cache applies to the host and disk tiers only")
        if self.cache_rows < 0 or (self.cache_bytes is not None and self.cache_bytes < 0):
            raise ValueError("cache_rows and cache_bytes must be >= 0")
        if not 0 <= self.cache_window < 1:
            raise ValueError(f"cache_window must be in [0, 1), got {self.cache_window}")
        parse_codec(self.table_dtype)  # a clear error for an unknown table dtype, before anything loads

    def replace(self, **changes) -> "Placement":
        """A copy with some fields changed."""
        return dataclasses.replace(self, **changes)

    @property
    def off_device(self) -> bool:
        """The rows live off the model's memory (host or disk): a ``TableStore`` serves them."""
        return not tier_of(self.tier).in_memory


def placement_of(tables: Placement | str | None = None, **fields) -> Placement:
    """``tables`` (a ``Placement``, a tier name, or None for ``device``) with ``fields`` set; fields given
    as None are left as they are (``placement_of("host", cache_rows=512, device=None)``)."""
    base = tables if isinstance(tables, Placement) else Placement() if tables is None else Placement(tables)
    changes = {k: v for k, v in fields.items() if v is not None}
    return base.replace(**changes) if changes else base
