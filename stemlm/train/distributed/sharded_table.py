"""A STEM table sharded across the ranks of a process group: each rank stores 1/N of the rows.

Split: **by row, token id modulo world size** (rank r stores ids r, r+N, r+2N, ...), not by layer.
Token frequencies are Zipfian, so a contiguous or per-layer split would put the hot rows (and their
optimizer traffic) on one rank; the modulo split spreads hot tokens evenly and keeps memory equal
for any number of table layers (a layer split needs N to divide the number of table layers).

A lookup is collective (every rank must call it, in the same order):

1. ``index``: every rank's unique ids are all-gathered and merged into the step's union ``u``
   (sorted); in a forward this happens once for all table layers (``Tables.rows``);
2. ``gather(u)``, per layer: each rank fills the rows of ``u`` it owns, zeros elsewhere; an
   all-reduce (sum) gives every rank all rows of ``u`` (each row has exactly one owner, so the sum
   is exact);
3. the ``(len(u), dim)`` result becomes a leaf recorded by the container (``Tables.rows``); after
   backward, ``own_grad`` all-reduces its gradient, divides by the world size (the mean over ranks,
   as DDP does for the backbone) and keeps the owner's rows. Ids it returns are *local* row indices,
   so the sparse optimizer runs unchanged on the shard.

All collectives are plain all_gather / all_reduce, available on gloo (CPU) and NCCL (GPU).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from ...model.tables import TableLookup, WeightRows, check_ids, unique_ids


class ShardedTable(WeightRows, TableLookup, nn.Module):
    """Rows ``id % world == rank`` of a ``num_rows × dim`` table, with the table lookup protocol.

    ``read_rows``/``write_rows`` take *local* row indices (``id // world``), as ``own_grad`` returns.
    """

    def __init__(self, full_num_rows: int, dim: int, rank: int, world_size: int, group=None):
        super().__init__()
        self.full_num_rows, self.dim = full_num_rows, dim
        self.rank, self.world_size, self.group = rank, world_size, group
        self.num_rows = len(range(rank, full_num_rows, world_size))  # local rows
        self.weight = nn.Parameter(torch.empty(self.num_rows, dim), requires_grad=False)
        self.sparse_grad = True

    @classmethod
    def from_full(cls, full: torch.Tensor, rank: int, world_size: int, group=None) -> "ShardedTable":
        """This rank's shard of a full ``(V, dim)`` table."""
        table = cls(full.shape[0], full.shape[1], rank, world_size, group)
        with torch.no_grad():
            table.weight.copy_(full[rank::world_size])
        return table

    def _union_ids(self, local_unique: torch.Tensor) -> torch.Tensor:
        sizes = [torch.zeros(1, dtype=torch.long, device=local_unique.device) for _ in range(self.world_size)]
        dist.all_gather(sizes, torch.tensor([local_unique.numel()], device=local_unique.device), group=self.group)
        longest = int(max(s.item() for s in sizes))
        padded = torch.full((longest,), -1, dtype=torch.long, device=local_unique.device)
        padded[: local_unique.numel()] = local_unique
        gathered = [torch.empty_like(padded) for _ in range(self.world_size)]
        dist.all_gather(gathered, padded, group=self.group)
        union = torch.unique(torch.cat(gathered))
        return union[union >= 0]

    def index(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(union, inverse)``: the sorted union of every rank's ids and, for each position of
        ``ids``, its row in the union (collective)."""
        check_ids(ids, self.full_num_rows)
        local_unique, inverse = unique_ids(ids)
        union = self._union_ids(local_unique)  # (U,) sorted
        position = torch.searchsorted(union, local_unique)  # local unique id -> row of the union
        return union, position[inverse]

    def gather(self, union: torch.Tensor) -> torch.Tensor:
        """Rows ``(U, dim)`` of the union (collective: every row from its owner)."""
        owned = union % self.world_size == self.rank
        rows = torch.zeros(union.numel(), self.dim, dtype=self.weight.dtype, device=self.weight.device)
        rows[owned] = self.weight.detach()[union[owned] // self.world_size]
        dist.all_reduce(rows, group=self.group)  # (U, dim)
        return rows

    def own_grad(self, union: torch.Tensor, leaf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(local_row_ids, gradient)`` of the owned rows of a recorded leaf over ``union``, the gradient
        averaged over ranks (collective: every rank calls it for the same leaves, gradient or not)."""
        grad = leaf.grad.clone() if leaf.grad is not None else torch.zeros_like(leaf)
        dist.all_reduce(grad, group=self.group)
        grad /= self.world_size
        owned = union % self.world_size == self.rank
        return union[owned] // self.world_size, grad[owned]

    def gather_full(self) -> torch.Tensor:
        """The full ``(V, dim)`` table on every rank (collective), e.g. for saving a checkpoint."""
        return gather_interleaved(self.weight.detach(), self.full_num_rows, self.rank, self.world_size, self.group)


def gather_interleaved(local: torch.Tensor, full_rows: int, rank: int, world_size: int, group=None) -> torch.Tensor:
    """Reassemble a tensor whose rows ``rank::world_size`` each rank holds (collective).

    Used for tables and for per-row optimizer state (moments, counters) alike.
    """
    full = torch.zeros((full_rows, *local.shape[1:]), dtype=local.dtype, device=local.device)
    full[rank::world_size] = local
    dist.all_reduce(full, group=group)
    return full
