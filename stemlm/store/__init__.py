"""Where the rows of STEM tables live: a ``Placement`` (tier, tables file, cache, prefetch, table dtype,
device) and ``open_model(checkpoint, placement)``, the one way every command opens a model; the tiers
themselves are named once, in ``tiers.py`` (one class each).

``device`` (``StemTable``s in the model's memory), ``host`` (CPU RAM) and ``disk`` (a
memory-mapped safetensors file) tiers; a ``TableStore`` installed as ``model.tables`` owns the
offloaded tables with their backends, hot-row caches on the compute device and the prefetch worker
that gathers the rows of all layers in the background; row-sparse training goes through
``read_rows``/``write_rows``. See docs/offload.md.
"""

from .backends import DiskRows, HostRows, QuantRows
from .cache import HotRowCache
from .offload import offload_tables, open_model
from .placement import Placement, placement_of
from .prefetch import Prefetcher
from .table import OffloadedTable, TableStore
from .tiers import TIERS, export_tables, table_key, tier_of

__all__ = ["TIERS", "DiskRows", "HostRows", "HotRowCache", "OffloadedTable", "Placement", "Prefetcher", "QuantRows",
           "TableStore", "export_tables", "offload_tables", "open_model", "placement_of", "table_key", "tier_of"]
