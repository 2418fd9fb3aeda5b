"""Choosing the table path of a training run (``run.table_path``, ``run.tables``) and applying it."""

from __future__ import annotations

import warnings

import torch
import torch.nn as nn

from ...config import ConfigError
from ...kernels import resolve_table_kernels
from ...kernels import self_test as kernel_self_test
from ...model.tables import StemTable
from .host import install_host_tables
from .stacked import install_fused_tables


def fusable(model: nn.Module) -> bool:
    """Whether the fused path can take the model's tables: in-memory fp32 ``StemTable``s."""
    tables = list(getattr(model, "tables", {}).values())
    return bool(tables) and all(type(t) is StemTable and t.weight.dtype == torch.float32 for t in tables)


def resolve_table_path(table_path: str, tables_tier: str, table_optimizer: str, device: torch.device,
                       model: nn.Module) -> str:
    """``"fused"`` or ``"reference"`` for these settings, or a one-line ``ConfigError``."""
    want_host = tables_tier == "host"
    if table_path == "auto":
        table_path = "fused" if (device.type == "cuda" or want_host) else "reference"
        if not fusable(model) or table_optimizer != "sparse":
            table_path = "reference"
    if want_host and table_path != "fused":
        raise ConfigError("run.tables=host trains through the fused table path: use run.table_path=fused "
                          "(or auto) with optim.table_optimizer=sparse and in-memory tables")
    if table_path == "fused":
        if table_optimizer != "sparse":
            raise ConfigError("run.table_path=fused needs optim.table_optimizer=sparse")
        if not fusable(model):
            raise ConfigError("run.table_path=fused needs the model's tables in memory as fp32 StemTables "
                              "(not sharded, offloaded or quantized); use run.table_path=reference")
    return table_path


def apply_table_path(model: nn.Module, table_path: str, tables_tier: str, device: torch.device,
                     table_kernels: str = "torch", cache_ids: torch.Tensor | None = None) -> str | None:
    """Install the fused container (``FusedTables`` or, for ``tables_tier="host"``, ``HostTables``)
    as ``model.tables`` when ``table_path`` is ``"fused"`` (after the model is on ``device``), with
    the kernels ``table_kernels`` resolves to (``auto``/``triton``/``torch``) and, for host tables, the
    rows ``cache_ids`` kept on the device; returns the kernels (None on the reference path)."""
    if table_path != "fused":
        return None
    try:
        kernels = resolve_table_kernels(table_kernels, device)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if kernels == "triton" and table_kernels == "auto":  # the default: only kernels that ran and agreed here
        problem = kernel_self_test(device)
        if problem:
            warnings.warn(f"{problem}; training with run.table_kernels=torch", stacklevel=2)
            kernels = "torch"
    if tables_tier == "host":
        install_host_tables(model, device, kernels, cache_ids=cache_ids)
    else:
        install_fused_tables(model, kernels=kernels)
    return kernels


def hot_ids(tokens, vocab_size: int, n: int) -> torch.Tensor:
    """The ``n`` most frequent ids of a token array (ties: the smaller id first), for the hot-row cache."""
    import numpy as np

    counts = np.bincount(np.asarray(tokens, dtype=np.int64), minlength=vocab_size)[:vocab_size]
    order = np.lexsort((np.arange(vocab_size), -counts))  # by count descending, then id
    return torch.from_numpy(np.sort(order[:min(n, vocab_size)]).astype(np.int64))
