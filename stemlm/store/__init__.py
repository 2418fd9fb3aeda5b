"""Tiered storage for STEM tables behind the table lookup API.

``device`` (``StemTable`` in the model's memory), ``host`` (CPU RAM) and ``disk`` (a
memory-mapped safetensors file) tiers; deduplicated lookups, asynchronous prefetch of the rows of
all layers, an LFU hot-row cache on the compute device, and row-sparse training through
``read_rows``/``write_rows``. See docs/offload.md.
"""

from .backends import DiskRows, HostRows
from .cache import HotRowCache
from .offload import TIERS, TableStore, export_tables, load_model_with_tables, offload_tables, store_of, table_key
from .prefetch import Prefetcher
from .safetensors_io import TableFileError, read_header, write_safetensors
from .table import OffloadedTable, TableStats

__all__ = ["TIERS", "DiskRows", "HostRows", "HotRowCache", "OffloadedTable", "Prefetcher", "TableFileError", "TableStats",
           "TableStore", "export_tables", "load_model_with_tables", "offload_tables", "read_header", "store_of",
           "table_key", "write_safetensors"]
