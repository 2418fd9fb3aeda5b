"""``train(cfg)``: run a training in this process, or as one rank of a ``torchrun`` job.

The loop (``loop.Trainer``) knows nothing of distribution; under ``torchrun`` (``WORLD_SIZE`` > 1)
its seams are filled in by ``dist.trainer.DistributedTrainer``. This module picks between them, so
neither imports the other's caller.
"""

from __future__ import annotations

import os

from .config import TrainConfig
from .loop import Trainer
from .result import TrainResult


def train(cfg: TrainConfig, resume: bool = False, stop_at: int | None = None,
          allow_changes: tuple[str, ...] = ()) -> TrainResult:
    """Run (or ``resume``) the training described by ``cfg``; ``stop_at`` pauses early (see ``Trainer.fit``).

    ``allow_changes`` names the ``optim.*``/``data.*`` fields that may differ from the resumed
    checkpoint's config (recorded in ``metrics.jsonl``, the checkpoints and ``config.yaml``).
    Under ``torchrun`` (``WORLD_SIZE`` > 1) the run is distributed (``stemlm.train.distributed.trainer``).
    """
    trainer_cls = Trainer
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        from .distributed.trainer import DistributedTrainer as trainer_cls
    with trainer_cls(cfg, resume=resume, allow_changes=allow_changes) as trainer:
        return trainer.fit(stop_at=stop_at)
