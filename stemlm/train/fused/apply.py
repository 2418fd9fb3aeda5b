"""Choosing the table path of a training run (``run.table_path``, ``run.tables``) and applying it."""

from __future__ import annotations

import warnings

import torch
import torch.nn as nn

from ...config import ConfigError
from ...kernels import load as load_kernels
from ...kernels import resolve_table_kernels
from ...model.tables import StemTable
from ...store import Placement, offload_tables
from ...store.tiers import tier_of
from .host import install_host_tables
from .slab import install_slab_tables
from .kernels import indexed_update_
from .stacked import install_fused_tables


def fusable(model: nn.Module) -> bool:
    """Whether the fused path can take the model's tables: in-memory fp32 ``StemTable``s of one shape, all
    indexed by the same keys (not a model with token- and n-gram-keyed layers, ``StemLM.mixed_keys``)."""
    tables = list(getattr(model, "tables", {}).values())
    return (bool(tables) and all(type(t) is StemTable and t.weight.dtype == torch.float32 for t in tables)
            and len({t.weight.shape for t in tables}) == 1 and not getattr(model, "mixed_keys", False))


def resolve_table_path(table_path: str, tables_tier: str, table_optimizer: str, device: torch.device,
                       model: nn.Module) -> str:
    """``"fused"`` or ``"reference"`` for these settings, or a one-line ``ConfigError``.

    Tables off the device (``tables_tier`` other than ``device``) train row-sparse: on the fused path
    in host RAM (``HostTables``), on the reference path on any tier, served by its ``TableStore``."""
    want_host, off_device = tables_tier == "host", tables_tier != "device"
    if off_device and table_optimizer != "sparse":
        raise ConfigError(f"run.tables={tables_tier}: tables off the device train with the row-sparse optimizer; "
                          "use optim.table_optimizer=sparse")
    if table_path == "auto":
        table_path = "fused" if (device.type == "cuda" or want_host) else "reference"
        if not fusable(model) or table_optimizer != "sparse" or (off_device and not want_host):
            table_path = "reference"
    if off_device and not want_host and table_path == "fused":
        raise ConfigError(f"run.tables={tables_tier} trains through the reference table path (the fused one keeps "
                          "tables on the device or in host RAM): use run.table_path=reference or auto")
    if table_path == "fused":
        if table_optimizer != "sparse":
            raise ConfigError("run.table_path=fused needs optim.table_optimizer=sparse")
        if not fusable(model):
            raise ConfigError("run.table_path=fused needs the model's tables in memory as fp32 StemTables "
                              "(not sharded, offloaded or quantized); use run.table_path=reference")
    return table_path


def apply_table_path(model: nn.Module, table_path: str, tables_tier: str, device: torch.device,
                     table_kernels: str = "torch", cache_ids: torch.Tensor | None = None,
                     tables_file=None, slab_rows: int | None = None) -> str | None:
    """Install the tables' container for training (after the model is on ``device``); returns the kernels of
    the fused path (None on the reference path).

    Fused: ``FusedTables`` or, for ``tables_tier="host"``, ``HostTables``, with the kernels ``table_kernels``
    resolves to (``auto``/``triton``/``torch``) and, for host tables, the rows ``cache_ids`` kept on the device;
    with ``slab_rows`` host tables train through a fixed device slab of that many slots (``SlabTables``: the
    step can run on fixed buffers, ``run.step_graph=static``/``graph``).
    Reference, off the device: the tier's ``TableStore``, as serving installs it (``offload_tables``; a tier
    that serves a file writes the rows into ``tables_file``)."""
    if table_path != "fused":
        if tables_tier != "device":
            offload_for_training(model, tables_tier, device, tables_file)
        return None
    try:
        kernels = resolve_table_kernels(table_kernels, device)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if kernels == "triton" and table_kernels == "auto":  # the default: only kernels that ran and agreed here
        problem = triton_self_test(device)
        if problem:
            warnings.warn(f"{problem}; training with run.table_kernels=torch", stacklevel=2)
            kernels = "torch"
    if tables_tier == "host" and slab_rows:
        install_slab_tables(model, device, slab_rows, kernels, cache_ids=cache_ids)
    elif tables_tier == "host":
        install_host_tables(model, device, kernels, cache_ids=cache_ids)
    else:
        install_fused_tables(model, kernels=kernels)
    return kernels


def slab_rows_for(cfg, model: nn.Module, device: torch.device, cache_ids: torch.Tensor | None) -> int | None:
    """The device slab of host-RAM tables under an explicit fixed-buffer step (``run.tables=host`` with
    ``run.step_graph=static``/``graph``): ``run.table_slab_rows``, or the table keys of two steps plus the
    hot-row cache; None (no slab) otherwise."""
    if cfg.run.tables != "host" or cfg.run.step_graph not in ("static", "graph"):
        return None
    B, T = cfg.data.batch_size, cfg.data.seq_len
    keys = model.table_keys(torch.zeros(B, T, dtype=torch.long, device=device)).numel() * cfg.optim.grad_accum
    return cfg.run.table_slab_rows or 2 * keys + (len(cache_ids) if cache_ids is not None else 0)


def offload_for_training(model: nn.Module, tier: str, device: torch.device, tables_file=None):
    """Move ``model.tables`` to ``tier`` for training on the reference path: the same ``TableStore`` and
    backends ``stemlm serve`` uses, without a prefetch worker (the forward gathers); rows are written back
    by the row-sparse optimizer (``write_rows``). A tier that serves a file gets ``tables_file`` (replaced if
    it exists: a resume then loads the checkpoint's rows into it)."""
    file_tier = tier_of(tier).serves_file
    placement = Placement(tier, tables_file=tables_file if file_tier else None, writable=file_tier, prefetch=False,
                          device=device)
    return offload_tables(model, placement, overwrite=True)


def hot_ids(tokens, vocab_size: int, n: int) -> torch.Tensor:
    """The ``n`` most frequent ids of a token array (ties: the smaller id first), for the hot-row cache."""
    import numpy as np

    counts = np.bincount(np.asarray(tokens, dtype=np.int64), minlength=vocab_size)[:vocab_size]
    order = np.lexsort((np.arange(vocab_size), -counts))  # by count descending, then id
    return torch.from_numpy(np.sort(order[:min(n, vocab_size)]).astype(np.int64))


def triton_self_test(device: torch.device | str) -> str | None:
    """Run every kernel once on a few rows on ``device`` against its torch reference; None when they
    agree, else what failed (one line). ``auto`` uses the Triton kernels only after this passes, so a
    Triton that cannot compile them falls back to the torch kernels instead of failing a run."""
    try:
        gated, adamw = load_kernels(device)
        gen = torch.Generator(device="cpu").manual_seed(0)
        N, F, P = 40, 96, 6
        inverse = torch.randint(0, P, (N,), generator=gen)
        rows, g, dh = (torch.randn(*s, generator=gen) for s in ((P, F), (N, F), (N, F)))
        rows, g, dh, inverse = (t.to(device) for t in (rows, g, dh, inverse))
        g.requires_grad_(True)
        row_grad = torch.zeros(P, F, device=device)
        gated.gated_rows(g, rows, inverse, gated.Segments.of(inverse, P), row_grad).backward(dh)
        g_ref, rows_ref = g.detach().clone().requires_grad_(True), rows.clone().requires_grad_(True)
        gated.gated_rows_reference(g_ref, rows_ref, inverse).backward(dh)
        w, m, v = (torch.randn(8, F, generator=gen).to(device) for _ in range(3))
        v = v.abs()
        flat = torch.arange(0, 8, 2, device=device)
        fac = [torch.full((4, 1), x, device=device) for x in (0.99, -1e-3, 1e-8)]
        want = [t.clone() for t in (w, m, v)]
        grad = torch.randn(4, F, generator=gen).to(device)
        indexed_update_(*want, flat, want[0][flat].clone(), grad, *fac, None, 0.9, 0.95)
        got = [t.clone() for t in (w, m, v)]
        adamw.row_adamw_(*got, flat, got[0][flat].clone(), grad, *fac, None, 0.9, 0.95)
        for a, b in ((g.grad, g_ref.grad), (row_grad, rows_ref.grad), *zip(got, want)):
            if not torch.allclose(a, b, rtol=1e-4, atol=1e-5):
                return f"the Triton table kernels disagree with their torch reference on {device}"
    except Exception as e:  # a compile or launch failure: say it in one line
        return f"the Triton table kernels failed on {device}: {type(e).__name__}: {(str(e).splitlines() or [''])[0]}"
    return None
