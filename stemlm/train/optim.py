"""Optimizers of a run: torch AdamW for the backbone, a table optimizer for the STEM tables.

Parameter groups (each parameter in exactly one, asserted):

* ``decay``: matrices and embeddings of the backbone (``p.dim() >= 2``), ``weight_decay``;
* ``embed`` (only when ``embed_lr`` is set): the input embedding, ``weight_decay``, peak lr
  ``embed_lr`` (0 = frozen at its initial value: lr 0 also means no decay step);
* ``no_decay``: RMSNorm gains (1-D), never decayed: decaying a gain pulls the normalised
  activations toward zero instead of regularising a projection;
* ``tables`` (``table_optimizer="dense"`` only): the table weights in torch AdamW with
  ``table_lr`` / ``table_weight_decay``, exactly as plain AdamW over the whole table.

With ``table_optimizer="sparse"`` the tables are handled by ``SparseRowAdamW``, which works on
every table object in ``model.tables`` through the lookup protocol, so tables held off-device
(host RAM, disk) train the same way; when the fused table path installed a ``FusedTables`` (or
its host tier) as ``model.tables``, ``FusedRowAdamW`` updates all tables at once. Every group stores its peak lr as ``peak_lr``; the schedule
multiplies it.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from .config import OptimSection
from .sparse_adam import SparseRowAdamW


def build_optimizers(model: nn.Module, cfg: OptimSection) -> tuple[torch.optim.AdamW, SparseRowAdamW | None]:
    """``(AdamW over the backbone [+ tables in dense mode], SparseRowAdamW | FusedRowAdamW | None)``."""
    from .fused import FusedRowAdamW, FusedTables
    tables = dict(model.tables.items()) if hasattr(model, "tables") else {}
    table_params = {id(p) for t in tables.values() if isinstance(t, nn.Module) for p in t.parameters()}
    backbone = [p for p in _unique_params(model) if id(p) not in table_params and p.requires_grad]
    embed = getattr(model, "tok_embeddings", None)
    embed_ids = {id(embed.weight)} if cfg.embed_lr is not None and embed is not None else set()
    groups = [
        {"name": "decay", "params": [p for p in backbone if p.dim() >= 2 and id(p) not in embed_ids],
         "weight_decay": cfg.weight_decay, "peak_lr": cfg.lr},
        {"name": "no_decay", "params": [p for p in backbone if p.dim() < 2], "weight_decay": 0.0, "peak_lr": cfg.lr},
        {"name": "embed", "params": [p for p in backbone if id(p) in embed_ids], "weight_decay": cfg.weight_decay,
         "peak_lr": cfg.embed_peak_lr},
    ]
    table_opt = None
    if cfg.table_optimizer == "dense":
        params = []
        for name, table in tables.items():
            if not (isinstance(table, nn.Module) and list(table.parameters())):
                raise ValueError(f"table {name} holds no in-memory parameters; use optim.table_optimizer=sparse")
            table.sparse_grad = False
            params += list(table.parameters())
        groups.append({"name": "tables", "params": params, "weight_decay": cfg.table_weight_decay,
                       "peak_lr": cfg.table_peak_lr})
    elif isinstance(getattr(model, "tables", None), FusedTables):
        on_cuda = model.tables.device.type == "cuda"  # eager: ~30 small kernels; compiled: a few
        table_opt = FusedRowAdamW(model.tables, lr=cfg.table_peak_lr, betas=cfg.betas, eps=cfg.eps,
                                  weight_decay=cfg.table_weight_decay, decay_untouched=cfg.decay_untouched,
                                  compile=cfg.table_compile or on_cuda)
    elif tables:
        table_opt = SparseRowAdamW(model.tables, lr=cfg.table_peak_lr, betas=cfg.betas, eps=cfg.eps,
                                   weight_decay=cfg.table_weight_decay, decay_untouched=cfg.decay_untouched,
                                   compile=cfg.table_compile)
    groups = [g for g in groups if g["params"]]
    for g in groups:
        g["lr"] = g["peak_lr"]
    opt = _adamw(groups, cfg)
    check_coverage(model, opt, table_opt)
    return opt, table_opt


def _adamw(groups: list[dict], cfg: OptimSection) -> torch.optim.AdamW:
    """The fused AdamW kernel (one pass over each tensor), or the reference implementation where
    no fused kernel exists for the device/dtype."""
    try:
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, fused=True)
    except (RuntimeError, ValueError):
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps)


def check_coverage(model: nn.Module, opt: torch.optim.Optimizer, table_opt: SparseRowAdamW | None) -> None:
    """Assert the optimizers cover every trainable parameter of ``model`` exactly once."""
    seen: dict[int, str] = {}
    owners = [(g.get("name", "group"), g["params"]) for g in opt.param_groups]
    if table_opt is not None:
        owners.append(("sparse_tables", table_opt.parameters()))
    for owner, params in owners:
        for p in params:
            if id(p) in seen:
                raise AssertionError(f"a parameter is in both optimizer groups {seen[id(p)]!r} and {owner!r}")
            seen[id(p)] = owner
    missing = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in seen]
    if missing:
        raise AssertionError(f"parameters not in any optimizer group: {missing[:3]}")


def set_lr(opt: torch.optim.Optimizer, table_opt: SparseRowAdamW | None, factor: float, table_peak_lr: float) -> None:
    """Set every group's lr to its peak lr times the schedule ``factor``."""
    for g in opt.param_groups:
        g["lr"] = g["peak_lr"] * factor
    if table_opt is not None:
        table_opt.lr = table_peak_lr * factor


@torch.no_grad()
def clip_grad_norm(params: list[torch.Tensor], extra_grads: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Global L2 norm of the dense grads of ``params`` plus ``extra_grads`` (the coalesced sparse
    table grads); when ``max_norm > 0`` all of them are scaled in place so the norm is at most
    ``max_norm``. Returns the norm before clipping, on the grads' device: nothing here waits for
    an accelerator (``torch._foreach_norm``: one kernel per device and dtype)."""
    grads = [p.grad for p in params if p.grad is not None] + list(extra_grads)
    if not grads:
        return torch.zeros(())
    total = torch.nn.utils.get_total_norm([g.detach() for g in grads], 2.0)
    if max_norm > 0:
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for group in _by_device_dtype(grads).values():
            torch._foreach_mul_(group, coef.to(group[0].device, group[0].dtype))
    return total


def _by_device_dtype(tensors: list[torch.Tensor]) -> dict:
    out: dict = {}
    for t in tensors:
        out.setdefault((t.device, t.dtype), []).append(t)
    return out


def _unique_params(model: nn.Module) -> list[nn.Parameter]:
    """Parameters in registration order, tied ones once."""
    return list({id(p): p for p in model.parameters()}.values())
