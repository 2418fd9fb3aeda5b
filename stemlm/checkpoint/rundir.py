"""``RunDir``: the layout of a training run directory and its one "newest good checkpoint" rule.

A run directory (``stemlm train``'s ``run.out``) holds::

    config.yaml                   the training config (TrainConfig)
    config.json                   the model type, so AutoConfig / from_pretrained(run_dir) recognise the run
    metrics.jsonl, summary.json   one record per step; the finished run's summary
    checkpoints/step_XXXXXXXX/    complete checkpoints (a checkpoint directory plus optimizer and trainer
                                  state), each renamed into place when whole; corrupt-step_* are damaged
                                  ones moved aside

Every part of stemlm that needs a path in a run directory asks ``RunDir``; every command that takes a
run or a checkpoint resolves it with ``resolve_checkpoint`` (the newest checkpoint whose files match
their manifest; a damaged one is skipped with a warning).
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

from .integrity import CheckpointError, verify_checkpoint

CONFIG_FILE = "config.json"  # also in every checkpoint directory
TRAIN_CONFIG, METRICS, SUMMARY = "config.yaml", "metrics.jsonl", "summary.json"
TABLES_FILE = "tables.safetensors"  # the rows a run trains on the disk tier (run.tables=disk)
CHECKPOINTS, STEP_PREFIX, TRAINER_STATE = "checkpoints", "step_", "trainer_state.json"


class CheckpointWarning(UserWarning):
    """A damaged checkpoint was skipped."""


class RunDir:
    """A training run directory (see the module docstring)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)

    def __repr__(self) -> str:
        return f"RunDir({str(self.path)!r})"

    # -- layout -------------------------------------------------------------------------------
    @property
    def checkpoints_dir(self) -> Path:
        return self.path / CHECKPOINTS

    def checkpoint(self, step: int) -> Path:
        """Where the checkpoint of ``step`` is (or will be) written."""
        return self.checkpoints_dir / f"{STEP_PREFIX}{step:08d}"

    @property
    def train_config(self) -> Path:
        return self.path / TRAIN_CONFIG

    @property
    def model_config(self) -> Path:
        return self.path / CONFIG_FILE

    @property
    def metrics(self) -> Path:
        return self.path / METRICS

    @property
    def summary(self) -> Path:
        return self.path / SUMMARY

    @property
    def tables_file(self) -> Path:
        """The tables file of a run that trains its tables on a tier that serves a file (``run.tables=disk``)."""
        return self.path / TABLES_FILE

    @staticmethod
    def holds_run(path: str | os.PathLike) -> bool:
        """Whether ``path`` is a run directory (it has ``checkpoints/``)."""
        return (Path(path) / CHECKPOINTS).is_dir()

    # -- checkpoints ----------------------------------------------------------------------------
    def checkpoints(self) -> list[Path]:
        """Complete checkpoints, oldest first (a directory is complete once renamed into place)."""
        root = self.checkpoints_dir
        if not root.is_dir():
            return []
        return sorted(p for p in root.glob(f"{STEP_PREFIX}*")
                      if (p / TRAINER_STATE).exists() and (p / CONFIG_FILE).exists())

    def newest_good(self, verify: bool = True, move_aside: bool = False) -> Path | None:
        """The newest checkpoint whose files match their manifest (None when the run has none).

        A damaged one is skipped with a ``CheckpointWarning``; ``move_aside`` (the trainer, which owns
        the run) also renames it ``corrupt-step_*`` so no later resume or rotation takes it for good.
        Raises ``CheckpointError`` when checkpoints exist and none verifies. ``verify=False`` takes the
        newest complete one unchecked.
        """
        found = self.checkpoints()
        if not verify:
            return found[-1] if found else None
        newest_error = None
        for ckpt in reversed(found):
            try:
                verify_checkpoint(ckpt)
                return ckpt
            except CheckpointError as e:
                newest_error = newest_error or str(e)
                where = ""
                if move_aside:
                    aside = _aside(ckpt)
                    os.replace(ckpt, aside)
                    where = f" (moved to {aside.name})"
                warnings.warn(f"skipping damaged checkpoint {ckpt.name}{where}: {e}", CheckpointWarning, stacklevel=2)
        if found:
            advice = ("start a new run.out, or resume with run.verify_checkpoints=false at your own risk" if move_aside
                      else "pass a checkpoint directory, or --no-verify at your own risk")
            raise CheckpointError(f"no checkpoint of {self.path} verifies"
                                  f"{' (all moved aside as corrupt-step_*)' if move_aside else ''} (newest: {newest_error}); {advice}")
        return None


def resolve_checkpoint(path: str | os.PathLike, verify: bool = True) -> Path:
    """A checkpoint directory, or the newest good checkpoint of a run directory (``RunDir.newest_good``).

    A run directory's own ``config.json`` only names the model type for ``AutoConfig``: its weights are
    those of its newest good ``checkpoints/step_*``.
    """
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint path {path} does not exist")
    if RunDir.holds_run(path):
        ckpt = RunDir(path).newest_good(verify)
        if ckpt is not None:
            return ckpt
    elif (path / CONFIG_FILE).exists():
        return path
    raise CheckpointError(f"{path} is neither a checkpoint (no {CONFIG_FILE}) nor a run with checkpoints/step_*")


def _aside(ckpt: Path) -> Path:
    target, n = ckpt.with_name(f"corrupt-{ckpt.name}"), 1
    while target.exists():
        target, n = ckpt.with_name(f"corrupt-{ckpt.name}.{n}"), n + 1
    return target
