"""Distributed training under ``torchrun``: the single training loop with its seams filled in.

    torchrun --nproc-per-node 2 -m stemlm.train --preset debug --steps 20 --out runs/ddp

* process group: gloo on CPU, NCCL on CUDA (one GPU per local rank);
* backbone: DDP (``run.parallel=ddp``, default) or FSDP2 ``fully_shard`` (``run.parallel=fsdp``);
* tables: ``ShardedTable`` — each rank stores the rows ``id % world == rank`` (see
  ``sharded_table.py`` for why by row and not by layer) and its slice of the row-sparse optimizer
  state; the sparse optimizer runs unchanged on the shard;
* data: rank ``r`` takes its slice of the same global batch (``get_batch(..., rank, world)``), so
  a run on N processes sees exactly the tokens of a 1-process run with the same ``batch_size``;
* the logged loss is the mean over ranks; the gradient norm covers the backbone (identical on
  every rank after DDP's all-reduce) and every rank's table rows (disjoint, summed);
* checkpoints are world-size independent: tables and their optimizer moments are gathered and
  rank 0 writes the same files a 1-process run writes; resuming slices them again.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import torch
import torch.distributed as dist

from ..checkpoint import WEIGHTS_FILE, load_state_into
from ..config import ConfigError
from ..data import get_batch
from ..model import StemLM
from ..tables import StemTable
from ..train import state as ckpt_io
from ..train.loop import Trainer
from .sharded_table import ShardedTable, gather_interleaved


def init_distributed(device: str) -> tuple[int, int, torch.device]:
    """Join the torchrun process group; ``(rank, world_size, device)``."""
    if not dist.is_initialized():
        use_cuda = device in ("cuda", "auto") and torch.cuda.is_available()
        dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if torch.cuda.is_available() and device in ("cuda", "auto"):
        local = int(os.environ.get("LOCAL_RANK", rank))
        torch.cuda.set_device(local)
        return rank, world, torch.device("cuda", local)
    return rank, world, torch.device("cpu")


def shard_tables(model: StemLM, rank: int, world: int) -> None:
    """Replace every in-memory table of ``model`` by this rank's ``ShardedTable``."""
    for name, table in list(model.tables.items()):
        if not isinstance(table, StemTable):
            raise ValueError(f"table {name} is not in memory ({type(table).__name__}); shard before offloading")
        model.tables[name] = ShardedTable.from_full(table.weight.detach(), rank, world).to(table.weight.device)


class DistributedTrainer(Trainer):
    """``Trainer`` for one rank of a torchrun job (see module docstring)."""

    def __init__(self, cfg, resume: bool = False):
        self.rank, self.world_size, device = init_distributed(cfg.run.device)
        if cfg.data.batch_size % self.world_size:
            raise ConfigError(f"data.batch_size={cfg.data.batch_size} is not divisible by the world size {self.world_size}")
        if cfg.optim.table_optimizer != "sparse":
            raise ConfigError("distributed runs shard the tables: use optim.table_optimizer=sparse")
        self.parallel = getattr(cfg.run, "parallel", "ddp")
        if self.parallel not in ("ddp", "fsdp"):
            raise ConfigError(f"run.parallel must be 'ddp' or 'fsdp', got {self.parallel!r}")
        cfg.run.device = str(device)
        super().__init__(cfg, resume=resume)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    # -- seams ------------------------------------------------------------------------------
    def prepare_model(self, model: StemLM) -> StemLM:
        shard_tables(model, self.rank, self.world_size)
        if self.parallel == "fsdp":
            from torch.distributed.fsdp import fully_shard
            for block in model.layers:
                fully_shard(block)
            fully_shard(model)
        return model

    def wrap_forward(self, model):
        if self.parallel == "fsdp":
            return model  # fully_shard already reduces gradients
        from torch.nn.parallel import DistributedDataParallel
        ids = [self.device.index] if self.device.type == "cuda" else None
        # DDP broadcasts rank 0's state at construction: the table shards differ per rank, keep them out
        shards = [name for name, _ in model.named_parameters() if name.startswith("tables.")]
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, shards)
        return DistributedDataParallel(model, device_ids=ids)

    def batch(self, micro_step: int):
        d = self.cfg.data
        return get_batch(self.train_ds, micro_step, d.batch_size, d.seq_len, seed=d.seed,
                         rank=self.rank, world_size=self.world_size).to(self.device)

    def reduce_loss(self, loss: torch.Tensor) -> float:
        total = loss.detach().float().clone()
        dist.all_reduce(total)
        return total.item() / self.world_size

    @torch.no_grad()
    def clip_gradients(self, params, table_grads):
        grads = [p.grad for p in params if p.grad is not None]
        backbone_sq = sum((_local(g).float().pow(2).sum() for g in grads), torch.zeros((), device=self.device))
        if self.parallel == "fsdp":  # each rank holds a shard of every gradient
            dist.all_reduce(backbone_sq)
        table_sq = sum((g.float().pow(2).sum() for g in table_grads), torch.zeros((), device=self.device))
        dist.all_reduce(table_sq)  # the ranks' rows are disjoint
        total = (backbone_sq + table_sq).sqrt()
        max_norm = self.cfg.optim.grad_clip
        if max_norm > 0:
            coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
            for g in grads + list(table_grads):
                g.mul_(coef.to(g.dtype))
        return total.cpu()

    # -- checkpoints --------------------------------------------------------------------------
    def save(self) -> Path:
        """Gather tables and their optimizer moments (collective); rank 0 writes a 1-process checkpoint."""
        full_tables = {n: t.gather_full() for n, t in self.model.tables.items()}
        full_state = {n: {k: gather_interleaved(v, self.model.tables[n].full_num_rows, self.rank, self.world_size)
                          for k, v in st.items()} for n, st in sorted(self.table_opt.state.items())}
        path = ckpt_io.checkpoint_dir(self.run_dir, self.step)
        if self.is_main:
            with _full_view(self.model, self.table_opt, full_tables, full_state):
                path = super().save()
        dist.barrier()
        self.last_ckpt = path
        return path

    def _restore(self, ckpt: Path) -> None:
        full = StemLM(self.model.cfg)
        load_state_into(full, ckpt / WEIGHTS_FILE)
        backbone = {k: v for k, v in full.state_dict().items() if not k.startswith("tables.")}
        self.model.load_state_dict(backbone, strict=False)
        with torch.no_grad():
            for name, table in self.model.tables.items():
                table.weight.copy_(full.tables[name].weight[self.rank::self.world_size])
        rows = lambda t: t[self.rank::self.world_size].clone()  # noqa: E731
        ckpt_io.load_optimizer_state(ckpt, self.opt, self.table_opt, table_rows=rows)
        st = ckpt_io.read_trainer_state(ckpt)
        self.step, self.tokens_seen, self.flops_seen = st["step"], st["tokens_seen"], st["flops_seen"]
        self.spikes.load_state_dict(st["spikes"])
        self.last_ckpt = ckpt


def _local(grad: torch.Tensor) -> torch.Tensor:
    """The local shard of a (possibly DTensor) gradient."""
    return grad.to_local() if hasattr(grad, "to_local") else grad


@contextlib.contextmanager
def _full_view(model: StemLM, table_opt, full_tables: dict, full_state: dict):
    """Temporarily give ``model`` full in-memory tables and ``table_opt`` the full state."""
    sharded, state = dict(model.tables.items()), table_opt.state
    try:
        for name, weight in full_tables.items():
            table = StemTable(weight.shape[0], weight.shape[1])
            table.weight.data = weight
            model.tables[name] = table
        table_opt.state = full_state
        yield
    finally:
        for name, table in sharded.items():
            model.tables[name] = table
        table_opt.state = state

