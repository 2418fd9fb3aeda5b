"""The whole pipeline: training stages, the optional eval stage, then the report."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

from .spec import STAGES

ALL_STAGES = (*STAGES, "timing", "eval")


def default_dirs(spec: dict) -> tuple[Path, Path]:
    """``(results, scratch)``: ``results/study/<name>`` (committed JSON) and ``runs/study/<name>`` (not committed)."""
    return Path("results/study") / spec["name"], Path("runs/study") / spec["name"]


def parse_stages(text: str | None) -> tuple[str, ...]:
    """``'compare,eval'`` -> ``('compare', 'eval')``; None -> every stage (``stability`` is the sweep's)."""
    if not text:
        return ALL_STAGES
    stages = tuple("sweep" if s.strip() == "stability" else s.strip() for s in text.split(",") if s.strip())
    unknown = [s for s in stages if s not in ALL_STAGES]
    if unknown:
        raise ValueError(f"unknown stage {unknown[0]!r}; choose from {', '.join(ALL_STAGES)}")
    return stages


def run_study(spec: dict, results_dir: str | Path, scratch_dir: str | Path, stages: tuple[str, ...] = ALL_STAGES,
              skip_eval: bool = False, report: bool = True, log: Callable[[str], None] = print,
              allow_dirty: bool | None = None) -> dict:
    """Run the selected stages of ``spec`` (finished runs are skipped), evaluate, write the report.

    ``allow_dirty``: train from a checkout with uncommitted changes (None: ``STEMLM_ALLOW_DIRTY``).
    Returns ``{"runs": counts, "eval": counts or None, "report": path or None, "seconds": wall time}``.
    """
    from .evalstage import run_evals
    from .report import write_report
    from .runner import Study
    from .timing import run_timing

    t0 = time.perf_counter()
    study = Study(spec, results_dir, scratch_dir, log, allow_dirty)
    counts = study.run(tuple(s for s in stages if s in STAGES))
    if "timing" in stages:
        run_timing(study, log)
    evals = None
    if "eval" in stages and not skip_eval:
        evals = run_evals(study)
    elif "eval" in stages:
        log("eval stage skipped (--skip-eval)")
    path = write_report(results_dir) if report and any((Path(results_dir) / "runs").glob("*.json")) else None
    return {"runs": counts, "eval": evals, "report": path, "seconds": time.perf_counter() - t0}
