"""Tiered storage for STEM tables behind the table lookup API.

``device`` (``StemTable``s in the model's memory), ``host`` (CPU RAM) and ``disk`` (a
memory-mapped safetensors file) tiers; a ``TableStore`` installed as ``model.tables`` owns the
offloaded tables with their backends, hot-row caches on the compute device and the prefetch worker
that gathers the rows of all layers in the background; row-sparse training goes through
``read_rows``/``write_rows``. See docs/offload.md.
"""

from ..config import TIERS
from .backends import DiskRows, HostRows, QuantRows
from .cache import HotRowCache
from .offload import export_tables, load_model_with_tables, offload_tables, table_key
from .prefetch import Prefetcher
from .safetensors_io import TableFileError, read_header, read_metadata, write_safetensors
from .table import OffloadedTable, TableStore

__all__ = ["TIERS", "DiskRows", "HostRows", "HotRowCache", "OffloadedTable", "Prefetcher", "QuantRows", "TableFileError",
           "TableStore", "export_tables", "load_model_with_tables", "offload_tables", "read_header", "read_metadata",
           "table_key",
           "write_safetensors"]
