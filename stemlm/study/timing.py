"""The ``timing`` stage: each comparison variant's training step time, measured side by side.

A study's runs train one after another, on a machine that may be doing other work meanwhile, so
their own step times compare badly across variants. This stage builds every comparison variant
of each size (the training config of its first-seed comparison run, in a throw-away run dir),
runs ``warmup`` steps of each, then ``steps`` timed steps of each variant in turn for ``rounds``
rounds (the order rotating each round, so slow phases of the machine hit every variant), and keeps
each variant's median step time and its median per-round ratio to dense. The report draws loss
against wall time as ``step × median step time`` from it. Results: ``timing.json`` beside
``study.json``; a file measured with the same settings is kept (delete it to measure again).
"""

from __future__ import annotations

import shutil
import statistics
import time
from pathlib import Path

DEFAULTS = {"rounds": 3, "warmup": 2, "steps": 8}


def timing_settings(spec: dict) -> dict:
    """The spec's ``timing`` section over the defaults, with the variants and sizes it covers."""
    compare = spec.get("compare") or {}
    return {**DEFAULTS, **(spec.get("timing") or {}), "sizes": list(compare.get("sizes", [])),
            "variants": list(compare.get("variants", []))}


def run_timing(study, log=print) -> dict | None:
    """Measure (or keep) ``timing.json`` of ``study``; None when the spec has no comparison."""
    from .runner import provenance, read_json, write_json

    settings = timing_settings(study.spec)
    if not settings["sizes"]:
        log("timing: the spec has no compare stage, skipped")
        return None
    path = study.results / "timing.json"
    done = read_json(path)
    if done and done.get("settings") == settings:
        log(f"timing: measured earlier ({path}), kept")
        return done
    sizes = {}
    for size in settings["sizes"]:
        runs = timing_runs(study, size)
        log(f"timing: size {size}, {len(runs)} variants x {settings['rounds']} rounds x {settings['steps']} steps")
        sizes[size] = _time_size(study, runs, settings)
    result = {"settings": settings, "sizes": sizes, "measured": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **provenance()}
    write_json(path, result)
    return result


def timing_runs(study, size: str) -> list:
    """One run per comparison variant of ``size`` to time: its first-seed comparison run, or, while
    that waits for the sweep's lr, one of its sweep runs (the step time does not depend on the lr)."""
    runs = [r for r in study.runs if r.stage == "compare" and r.labels["size"] == size]
    first_seed = min(r.labels["seed"] for r in runs)
    out = []
    for r in (r for r in runs if r.labels["seed"] == first_seed):
        if r.pending:
            r = next((s for s in study.runs if s.stage == "sweep" and s.labels["variant"] == r.labels["variant"]
                      and s.labels["size"] == size), None)
        if r is not None:
            out.append(r)
    return out


def _time_size(study, runs, settings: dict) -> dict:
    """``{variant: {step_seconds, rounds, vs_dense}}`` for the comparison runs of one size."""
    from ..train import Trainer, TrainingDiverged

    root = study.scratch / "timing"
    trainers, diverged = {}, {}

    def steps(name: str, n: int) -> list[float]:
        try:
            return [trainers[name].train_step()["step_time"] for _ in range(n)]
        except TrainingDiverged as e:  # a config that diverges has no step time; the others go on
            diverged[name] = str(e).split(";")[0]
            return []

    try:
        for run in runs:
            out = root / run.name
            shutil.rmtree(out, ignore_errors=True)
            cfg = study.train_config(run, None, study.data_dir(run, None), out_dir=out)
            trainers[run.labels["variant"]] = Trainer(cfg)
            steps(run.labels["variant"], settings["warmup"])
        names = list(trainers)
        per_round: dict[str, list[float]] = {n: [] for n in names}
        for r in range(settings["rounds"]):
            for name in names[r % len(names):] + names[:r % len(names)]:
                if name not in diverged and (times := steps(name, settings["steps"])):
                    per_round[name].append(statistics.median(times))
    finally:
        for trainer in trainers.values():
            trainer.close()
        shutil.rmtree(root, ignore_errors=True)
    out = {}
    for name in names:
        if name in diverged:
            out[name] = {"step_seconds": None, "rounds": [], "vs_dense": None, "diverged": diverged[name]}
            continue
        times, dense = per_round[name], per_round.get("dense") or []
        ratios = [t / d for t, d in zip(times, dense)]
        out[name] = {"step_seconds": statistics.median(times), "rounds": times,
                     "vs_dense": statistics.median(ratios) if len(ratios) == len(times) else None}
    return out


def wall_from_timing(timing: dict | None, size: str, variant: str) -> float | None:
    """Seconds a step of ``variant`` takes by the side-by-side measurement (None if not measured)."""
    entry = ((timing or {}).get("sizes", {}).get(size) or {}).get(variant)
    return entry["step_seconds"] if entry else None


def load_timing(results_dir: str | Path) -> dict | None:
    """``timing.json`` of a results dir, if any."""
    from .runner import read_json

    return read_json(Path(results_dir) / "timing.json")


def estimate(study, timing: dict | None = None, eval_cost: float = 0.35, run_overhead: float = 5.0) -> dict:
    """Seconds each stage of ``study`` should take on the machine ``timing`` was measured on.

    A run costs ``steps × step time × (its tokens per step ÷ the compare budget's)`` plus its
    evaluations (``eval_batches`` forward passes per evaluation, each ``eval_cost`` of a step) and
    ``run_overhead`` seconds (model build, checkpoints, measures). The step time of a run is its
    variant's at its size from ``timing`` (the ``timing`` stage); a run whose variant was not timed
    takes dense's. Returns ``{"stages": {stage: seconds}, "runs": n, "untimed": [names]}``."""
    timing = timing or load_timing(study.results) or {}
    budget = study.spec["budget"]
    base_tokens = budget["batch_size"] * budget["seq_len"]
    stages: dict[str, float] = {}
    untimed = []
    for run in study.runs:
        ov = dict(o.split("=", 1) for o in run.overrides if "=" in o)
        # mid-training runs are a pretrained model's, not one of the spec's sizes: not timed here
        size = run.labels.get("size") or (None if run.stage == "midtrain" else next(iter(study.spec["sizes"] or {}), None))
        if size is None:
            untimed.append(run.name)
            continue
        variant = run.labels.get("variant", "dense")
        entry = ((timing.get("sizes") or {}).get(size) or {})
        step = (entry.get(variant) or entry.get("dense") or {}).get("step_seconds")
        if step is None:
            untimed.append(run.name)
            continue
        steps = int(ov.get("run.steps", budget["steps"]))
        tokens = int(ov.get("data.batch_size", budget["batch_size"])) * int(ov.get("data.seq_len", budget["seq_len"]))
        every = int(ov.get("run.eval_every", 100)) or steps
        evals = (steps // every + 1) * int(ov.get("run.eval_batches", 8)) * eval_cost
        seconds = step * tokens / base_tokens * (steps + evals) + run_overhead
        stages[run.stage] = stages.get(run.stage, 0.0) + seconds
    return {"stages": stages, "runs": len(study.runs), "untimed": untimed}
