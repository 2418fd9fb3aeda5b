"""What a training run reports (``summary.json``), and the stored report of a finished run."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..checkpoint.rundir import RunDir


@dataclass
class TrainResult:
    """What a finished run reports."""

    run_dir: Path
    steps: int
    train_loss: float | None
    val_loss: float | None
    tokens_seen: int
    flops_seen: float
    seconds: float
    checkpoint: Path | None
    loss_spikes: int
    export: Path | None = None  # run.anneal: the pure STEM model the annealed run became (``run_dir/stem``)
    matmul: str | None = None  # the GEMM backend the run used (``run.matmul`` resolved: aten | onednn)
    finished_before: bool = False  # the run was already complete: nothing was trained or written

    def summary(self) -> dict:
        """The content of ``summary.json``."""
        return {k: str(v) if isinstance(v, Path) else v for k, v in self.__dict__.items() if k != "finished_before"}


def finished_result(run_dir: Path, step: int) -> TrainResult | None:
    """The stored result of a run that already reached ``step`` = its last step (its
    ``summary.json``), or None when the run has not been completed and summarised."""
    try:
        data = json.loads(RunDir(run_dir).summary.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("steps") != step:
        return None
    fields = {k: data.get(k) for k in TrainResult.__dataclass_fields__ if k != "finished_before"}
    fields["run_dir"], fields["checkpoint"] = Path(run_dir), fields["checkpoint"] and Path(fields["checkpoint"])
    fields["export"] = fields["export"] and Path(fields["export"])
    return TrainResult(**fields, finished_before=True)
