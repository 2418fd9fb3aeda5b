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
  rank 0 writes the same files a 1-process run writes; resuming slices them again. The trainer
  state also holds every rank's RNG state (``rng_ranks``): a resume on the same world size
  restores each rank's own, another world size falls back to rank 0's (``rng``);
* rank 0 holds the run dir's lock and picks the checkpoint to resume for every rank.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import torch
import torch.distributed as dist

from ...config import ConfigError
from ...data import get_batch
from ...checkpoint.directory import WEIGHTS_FILE, CheckpointError, load_state_into
from ...checkpoint.integrity import non_finite
from ...model.decoder import StemLM
from ...runtime.matmul import resolve_matmul_backend, use_matmul_backend
from .. import state as ckpt_io
from ..loop import Trainer
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
        if not hasattr(table, "weight") or table.weight.shape[0] != model.cfg.table_rows(int(name)):
            raise ValueError(f"table {name} is not in memory ({type(table).__name__}); shard before offloading")
        model.tables[name] = ShardedTable.from_full(table.weight.detach(), rank, world).to(table.weight.device)


class DistributedTrainer(Trainer):
    """``Trainer`` for one rank of a torchrun job (see module docstring)."""

    def __init__(self, cfg, resume: bool = False, allow_changes: tuple[str, ...] = ()):
        self.rank, self.world_size, device = init_distributed(cfg.run.device)
        if cfg.data.batch_size % self.world_size:
            raise ConfigError(f"data.batch_size={cfg.data.batch_size} is not divisible by the world size {self.world_size}")
        if cfg.optim.table_optimizer != "sparse":
            raise ConfigError("distributed runs shard the tables: use optim.table_optimizer=sparse")
        self.parallel = cfg.run.parallel
        cfg.run.device = str(device)
        super().__init__(cfg, resume=resume, allow_changes=allow_changes)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    # -- seams ------------------------------------------------------------------------------
    def prepare_model(self, model: StemLM) -> StemLM:
        shard_tables(model, self.rank, self.world_size)
        if self.parallel == "fsdp":
            from torch.distributed.fsdp import fully_shard
            shards = {p for t in model.tables.values() for p in t.parameters()}  # already split by row
            for block in model.layers:
                fully_shard(block)
            fully_shard(model, ignored_params=shards)
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

    def host_batch(self, micro_step: int):
        d = self.cfg.data
        return get_batch(self.train_ds, micro_step, d.batch_size, d.seq_len, seed=d.seed,
                         rank=self.rank, world_size=self.world_size)

    def reduce_loss(self, loss: torch.Tensor) -> float:
        total = loss.detach().float().clone()
        dist.all_reduce(total)
        return total.item() / self.world_size

    def step_values(self, losses, norm):
        return [self.reduce_loss(loss) for loss in losses], float(norm)

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
    @contextlib.contextmanager
    def gathered_state(self):
        """Gather everything sharded (collective); the state a 1-process run writes, on every rank."""
        tables = {f"tables.{n}.weight": t.gather_full() for n, t in self.model.tables.items()}
        table_state = {n: {k: gather_interleaved(v, self.model.tables[n].full_num_rows, self.rank, self.world_size)
                           for k, v in st.items()} for n, st in sorted(self.table_opt.state.items())}
        backbone = {k: _full(v) for k, v in self.model.state_dict().items() if not k.startswith("tables.")}
        opt_state = self.opt.state_dict()  # its per-parameter dicts are the live state: copy, never mutate
        opt_state = {**opt_state, "state": {i: {k: _full(v) for k, v in st.items()} for i, st in opt_state["state"].items()}}
        every = [*backbone.items(), *tables.items(), *((f"{n}.{k}", v) for n, st in table_state.items() for k, v in st.items()),
                 *((f"dense.{i}.{k}", v) for i, st in opt_state["state"].items() for k, v in st.items()
                   if isinstance(v, torch.Tensor))]
        bad = non_finite(every)  # the same gathered tensors on every rank: all ranks stop together
        if bad:
            raise self.divergence(f"NaN/inf in {', '.join(bad)}; checkpoint not written", self.step,
                                  "the weights were updated")
        state = self.trainer_state()
        ranks = [None] * self.world_size
        dist.all_gather_object(ranks, state["rng"])
        with torch.device("meta"):
            snapshot = StemLM(self.model.cfg)
        snapshot.load_state_dict({**backbone, **tables}, strict=False, assign=True)
        with _swapped_state(self.table_opt, table_state):
            yield ckpt_io.SaveState(snapshot, _FixedState(opt_state), self.table_opt, {**state, "rng_ranks": ranks})

    def saved(self) -> None:
        """Every rank waits until rank 0 has written the checkpoint."""
        dist.barrier()

    def load_weights(self, ckpt: Path) -> None:
        """The whole checkpoint, then this rank's rows of every table."""
        if self.parallel == "fsdp":
            raise ConfigError("resuming with run.parallel=fsdp is not supported yet; checkpoints are world-size "
                              "independent, so resume this run with run.parallel=ddp or on one process")
        full = StemLM(self.model.cfg)
        load_state_into(full, ckpt / WEIGHTS_FILE)
        backbone = {k: v for k, v in full.state_dict().items() if not k.startswith("tables.")}
        self.model.load_state_dict(backbone, strict=False)
        with torch.no_grad():
            for name, table in self.model.tables.items():
                table.weight.copy_(full.tables[name].weight[self.rank::self.world_size])

    def load_optimizer_state(self, ckpt: Path) -> None:
        """The optimizer state of the checkpoint, the table moments of this rank's rows only."""
        rows = lambda t: t[self.rank::self.world_size].clone()  # noqa: E731
        ckpt_io.load_optimizer_state(ckpt, self.opt, self.table_opt, table_rows=rows)

    def resolve_matmul(self) -> str:
        """Rank 0 resolves ``run.matmul`` (``auto`` measures there alone) and every rank applies its pick:
        one set of GEMM numerics across ranks."""
        if not self.is_main:
            resolve_matmul_backend(self.cfg.run.matmul, self.device, self.cfg.run.dtype)  # rank 0's config errors
        pick = [super().resolve_matmul() if self.is_main else None]
        dist.broadcast_object_list(pick, src=0)
        use_matmul_backend(self.model, pick[0])
        return pick[0]

    def rng_of(self, state: dict) -> dict:
        ranks = state.get("rng_ranks") or []
        return ranks[self.rank] if len(ranks) == self.world_size else state["rng"]

    def find_resume_checkpoint(self) -> Path | None:
        """Rank 0 verifies and picks (moving damaged ones aside); every rank resumes the same one."""
        pick = [None]
        if self.is_main:
            try:
                found = super().find_resume_checkpoint()
                pick = [str(found) if found is not None else None]
            except CheckpointError as e:
                pick = [e]
        dist.broadcast_object_list(pick, src=0)
        if isinstance(pick[0], CheckpointError):
            raise pick[0]
        return Path(pick[0]) if pick[0] is not None else None


def _local(grad: torch.Tensor) -> torch.Tensor:
    """The local shard of a (possibly DTensor) gradient."""
    return grad.to_local() if hasattr(grad, "to_local") else grad


def _full(value):
    """A full tensor from a DTensor (collective under FSDP); anything else unchanged."""
    return value.full_tensor() if hasattr(value, "full_tensor") else value


class _FixedState:
    """An optimizer stand-in whose ``state_dict()`` is a precomputed (gathered) one."""

    def __init__(self, state: dict):
        self._state = state

    def state_dict(self) -> dict:
        return self._state


@contextlib.contextmanager
def _swapped_state(table_opt, full_state: dict):
    """Temporarily give the table optimizer the gathered full state (for writing)."""
    local, table_opt.state = table_opt.state, full_state
    try:
        yield
    finally:
        table_opt.state = local
