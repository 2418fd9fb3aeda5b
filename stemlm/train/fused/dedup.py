"""Deduplication of a step's token ids with static shapes: no host synchronisation.

``torch.unique`` returns as many ids as there are distinct ones, a data-dependent shape, so the
host must wait for the accelerator before it can launch anything that follows. ``dedup`` ranks
the ids with a presence mask and a cumulative sum over the vocabulary instead:

* ``present[j] = 1`` when id ``j`` occurs; ``csum = cumsum(present)``; ``count = csum[-1]``;
* the slot of a present id is its rank among the present ids (``csum - 1``), the slot of an absent
  id comes after all of them (``count + j - csum[j]``), so ``slot_of`` is a permutation of
  ``[0, V)`` and ``order`` (slot -> id) its inverse;
* the padded id list is ``order[:P]`` with ``P = min(N, V)`` (``N`` ids in all): slots
  ``[0, count)`` hold the distinct ids in ascending order (exactly ``torch.unique``'s output),
  the remaining slots hold distinct ids that do *not* occur, which receive no gradient and which
  the optimizer leaves unchanged (a masked update), so no slot ever aliases another.

``exact=True`` trims the list to ``count`` (one read of ``count``: free on the CPU, where the host
and the "device" are the same memory; the CPU path uses it so no work is spent on padding).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Dedup:
    """The distinct ids of a step: ``uniq (P,)`` slot -> id, ``count ()`` distinct ids (on the
    ids' device), ``slot_of (V,)`` id -> slot; ``padded`` when ``P`` may exceed ``count``."""

    uniq: torch.Tensor
    count: torch.Tensor
    slot_of: torch.Tensor
    padded: bool

    @property
    def size(self) -> int:
        """``P``, the number of slots."""
        return self.uniq.numel()

    def valid(self) -> torch.Tensor | None:
        """``(P,)`` True for slots holding an id of the step; None when every slot does."""
        if not self.padded:
            return None
        return torch.arange(self.size, device=self.uniq.device) < self.count

    def inverse(self, ids: torch.Tensor) -> torch.Tensor:
        """Slot of every id (any shape; the ids must be among the step's)."""
        return self.slot_of.index_select(0, ids.reshape(-1)).view(ids.shape)

    def contains(self, ids: torch.Tensor) -> torch.Tensor:
        """0-d bool: every id of ``ids`` is among the step's distinct ids (on the device, no sync)."""
        return (self.inverse(ids) < self.count).all()


def dedup(ids: torch.Tensor, num_rows: int, exact: bool = False) -> Dedup:
    """Distinct ids of ``ids`` (any shape, values in ``[0, num_rows)``) with static shapes."""
    flat = ids.reshape(-1)
    present = torch.zeros(num_rows, dtype=torch.int64, device=flat.device).index_fill_(0, flat, 1)  # (V,)
    csum = present.cumsum(0)  # (V,) distinct ids <= j
    count = csum[-1]
    ar = torch.arange(num_rows, device=flat.device)
    slot_of = torch.where(present.bool(), csum - 1, count + ar - csum)  # (V,) a permutation of [0, V)
    order = torch.empty_like(slot_of).scatter_(0, slot_of, ar)  # (V,) slot -> id
    size = int(count) if exact else min(flat.numel(), num_rows)
    return Dedup(order[:size], count, slot_of, padded=not exact)
