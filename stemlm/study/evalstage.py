"""The optional eval stage: ``stemlm eval`` on the study's checkpoints, in this process.

Each target is evaluated as

    stemlm eval --model CKPT --tasks T1,T2 --limit N --output OUT.json

would do it (``stemlm.eval.run.evaluate_paths``, called in-process), whose JSON is ``{"model": {...}, "stemlm": ..., "tasks": {TASK: {"acc", "acc_norm", "acc_stderr", "n", ...}}}``,
and stores it wrapped as ``<results>/eval/<run>.<point>.json`` with the run's spec hash, the tasks
and the limit (``point``: ``final``, or ``init`` for the model a mid-training run starts from). An
evaluation whose file has the run's hash and limit and covers its tasks is skipped (a mid-training
run evaluated on more tasks by its own spec counts for a study that asks for fewer). The spec's ``eval.command`` (a list of arguments, e.g.
another environment's ``stemlm eval``) runs that command as a subprocess instead.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from .runner import Study, read_json, write_json

DEFAULT_COMMAND = (sys.executable, "-m", "stemlm", "eval")


def eval_command(spec: dict) -> list[str]:
    return list((spec.get("eval") or {}).get("command") or DEFAULT_COMMAND)


def unavailable_reason(command: list[str]) -> str | None:
    """Why ``command`` cannot run (one line), or None if it looks runnable."""
    if tuple(command) == DEFAULT_COMMAND:
        return None  # evaluated in this process (stemlm.eval.run), which every stemlm has
    if shutil.which(command[0]) is None and not Path(command[0]).is_file():
        return f"eval command {command[0]!r} not found"
    return None


def eval_targets(study: Study) -> list[tuple[str, str, str, list[str]]]:
    """``(run name, point, checkpoint, tasks)`` of every finished run that asks for evaluation."""
    out = []
    for run in study.runs:
        res = study.result(run)
        if not run.eval_tasks or res is None or res["status"] != "finished":
            continue
        if run.eval_init and res.get("init_from"):
            out.append((run.name, "init", res["init_from"], run.eval_tasks))
        out.append((run.name, "final", study.checkpoint(run, res), run.eval_tasks))
    return out


def run_evals(study: Study) -> dict:
    """Evaluate every target not evaluated yet; returns counts (done, skipped, failed, unavailable)."""
    spec_eval = study.spec.get("eval") or {}
    limit = int(spec_eval.get("limit", 100))
    command = eval_command(study.spec)
    counts = {"done": 0, "skipped": 0, "failed": 0, "unavailable": 0}
    targets = eval_targets(study)
    if not targets:
        return counts
    reason = unavailable_reason(command)
    if reason:
        study.log(f"eval stage skipped: {reason}; the report shows no eval scores (use --skip-eval to silence this)")
        counts["unavailable"] = len(targets)
        return counts
    for name, point, ckpt, tasks in targets:
        out = study.results / "eval" / f"{name}.{point}.json"
        key = {"run_spec_hash": study.by_name[name].spec_hash, "limit": limit, "point": point}
        stored = read_json(out)
        if stored and all(stored.get(k) == v for k, v in key.items()) and set(tasks) <= set(stored.get("tasks") or []):
            counts["skipped"] += 1
            continue
        raw = study.scratch / "eval" / f"{name}.{point}.json"
        raw.parent.mkdir(parents=True, exist_ok=True)
        args = [*command, "--model", str(ckpt), "--tasks", ",".join(tasks), "--limit", str(limit), "--output", str(raw)]
        study.log(f"eval {name} ({point}): {' '.join(args[len(command):])}")
        data, error = _evaluate(command, args, tasks, ckpt, limit, raw)
        if data is None or not isinstance(data.get("tasks"), dict):
            study.log(f"eval {name} ({point}) failed: {error}")
            counts["failed"] += 1
            continue
        write_json(out, {"run": name, **key, "tasks": tasks, "checkpoint": str(ckpt), "result": data})
        counts["done"] += 1
    return counts


def _evaluate(command: list[str], args: list[str], tasks: list[str], ckpt, limit: int, raw: Path) -> tuple[dict | None, str]:
    """``(result JSON, error line)``: in this process for the default command, else as a subprocess."""
    if tuple(command) == DEFAULT_COMMAND:
        import torch

        from ..eval.run import evaluate_paths

        try:
            evaluate_paths([str(ckpt)], ",".join(tasks), limit=limit, output=raw, progress=False,
                           device="cuda" if torch.cuda.is_available() else "cpu")
        except (ValueError, FileNotFoundError, RuntimeError, OSError) as e:
            return None, f"{type(e).__name__}: {e}"
        return read_json(raw), "no JSON written"
    proc = subprocess.run(args, capture_output=True, text=True)
    data = read_json(raw) if proc.returncode == 0 else None
    return data, (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}, no JSON"])[-1]
