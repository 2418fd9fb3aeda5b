"""The fused table path: all tables of a model as one batched operation per step, no host syncs.

* ``dedup.py``: distinct ids of a step with static shapes (no ``torch.unique``);
* ``stacked.py``: ``FusedTables``, every table in one ``(n, V, d)`` tensor, one gather per step;
* ``kernels.py``: the row AdamW (eager, or compiled: Triton on CUDA, C++ on the CPU);
* ``optim.py``: ``FusedRowAdamW``, the table optimizer over all tables at once;
* ``host.py`` + ``mover.py``: ``HostTables``, tables and optimizer state in host RAM with a
  device window per step and the next step's rows copied on a side stream;
* ``slab.py``: ``SlabTables``, the same home in host RAM trained through a fixed device slab, so the
  step runs on fixed buffers and can be captured (``run.step_graph=static``/``graph``).

Applied from outside the model (``install_fused_tables``, ``install_host_tables``,
``install_slab_tables``); the
reference path (``Tables`` + ``SparseRowAdamW``) is unchanged and the tests hold both equal.
See docs/gpu.md.
"""

from .dedup import Dedup, dedup
from .host import HostTables, install_host_tables
from .optim import FusedRowAdamW
from .slab import SlabTables, install_slab_tables
from .stacked import FusedTables, install_fused_tables

__all__ = ["Dedup", "FusedRowAdamW", "FusedTables", "HostTables", "SlabTables", "dedup", "install_fused_tables",
           "install_host_tables", "install_slab_tables"]
