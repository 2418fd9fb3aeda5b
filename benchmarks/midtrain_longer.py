"""Does a longer mid-training close the distilled STEM conversion's gap? Dense continued and the distilled KD arm
of ``studies/midtrain-300k.yaml`` trained for more tokens, then scored zero-shot and paired item by item.

The 307,200-token study (docs/insertion.md) leaves the locally distilled STEM-1/3 conversion of SmolLM2-135M
(``stem-distilled-kd-linear``: KL to the dense model, its weight decayed linearly to 0) +0.18 nats behind dense
continued and 5.4 / 1.0 / 3.4 points below it on arc_easy / piqa / hellaswag. This script trains the same two
arms from the same converted models, on the same corpus, batches (8 x 256 tokens), lr, schedule shape and KL
term, for ``--steps`` steps (default 300: 614,400 tokens, a third of the corpus, no text seen twice), in bf16
autocast (``run.dtype=bfloat16``: about half the fp32 time on these cores, losses within 0.001 of fp32 at 307k
tokens, ``benchmarks/results/midtrain_*_bf16_307k.json``), then scores both final checkpoints with the study's
eval command (``stemlm eval --tasks arc_easy,piqa,hellaswag --limit 500``, fp32) and pairs them item by item.

It needs the study's prepared data and converted models (``stemlm study run --spec midtrain-300k --stages
midtrain``, which makes them under ``runs/study/midtrain-300k``). A finished arm (its ``summary.json`` at
``--steps``) and an existing eval are reused, and an arm with checkpoints resumes, so an interrupted run continues. The two arms train side by side,
one thread each (``--jobs 1`` one after the other on every thread); so do the two evals (a run left alone gets
every core).

``--kd-from-continued`` adds a third arm, ``distilled-kd-continued``: the same conversion and KL term, but the
teacher is dense continued itself (this script's dense arm, at its last step) instead of the dense conversion, and
the KL keeps its weight (``constant``, run.distill's default): the teacher now knows the corpus better than the
student's start does, which was the reason to decay it. It trains once the dense arm has finished, and is paired
with dense continued and with the KD-linear arm.

    python benchmarks/midtrain_longer.py                       # 300 steps, ~70 min of training + ~50 of evals
    python benchmarks/midtrain_longer.py --kd-from-continued   # + the arm taught by dense continued (~45 + 15 min)
    python benchmarks/midtrain_longer.py --steps 450 --runs runs/midtrain-921k
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from _train_bench import write_result

ROOT = Path(__file__).resolve().parent.parent
DENSE_MODEL, STEM_MODEL = "smollm2-dense-e47509b0", "smollm2-stem-96b3c8db"  # the study's converted models
STUDY_307K = ROOT / "results" / "study" / "midtrain-300k"


def train_args(study: Path, steps: int, dtype: str) -> dict[str, list[str]]:
    """Each arm's ``stemlm train`` overrides (the midtrain-300k spec's, ``steps`` long)."""
    convert, data = study / "convert", study / "data" / "smollm2" / "corpus"
    common = ["--preset", "tiny", f"data.dir={data}", "data.batch_size=8", "data.seq_len=256", "data.seed=0",
              "run.seed=0", f"run.steps={steps}", "run.stage=midtrain", "optim.lr=0.0003", "run.eval_every=16",
              "run.eval_batches=4", "run.ckpt_every=50", "run.keep_last=1", "run.log_every=10", f"run.dtype={dtype}"]
    return {"dense": common + [f"run.init_from={convert / DENSE_MODEL}"],
            "distilled-kd-linear": common + ["run.distill_schedule=linear", "run.distill_temperature=1.0",
                                             "run.distill_weight=0.5", f"run.distill={convert / DENSE_MODEL}",
                                             f"run.init_from={convert / STEM_MODEL}"]}


def kd_from_continued_args(study: Path, steps: int, dtype: str, teacher: str) -> list[str]:
    """The ``distilled-kd-continued`` arm's overrides: the KD-linear arm's, taught by ``teacher`` (dense continued's
    checkpoint) at a constant weight."""
    common = [o for o in train_args(study, steps, dtype)["distilled-kd-linear"]
              if not o.startswith(("run.distill=", "run.distill_schedule="))]
    return common + ["run.distill_schedule=constant", f"run.distill={teacher}"]


def train_command(stemlm: list[str], overrides: list[str], run: Path) -> list[str]:
    """``stemlm train`` for one arm into ``run``, resuming it if an interrupted start left checkpoints there."""
    resume = ["--resume"] if any((run / "checkpoints").glob("step_*")) else []
    return [*stemlm, "train", *resume, *overrides, f"run.out={run}"]


def finished(run: Path, steps: int) -> dict | None:
    """The run's summary if it trained all ``steps``."""
    path = run / "summary.json"
    if not path.is_file():
        return None
    summary = json.loads(path.read_text())
    return summary if summary.get("steps") == steps else None


def run_side_by_side(commands: dict[str, list[str]], logs: dict[str, Path], threads: dict[str, int]) -> dict[str, float]:
    """Start every command at once, each with the cores left to it (``OMP_NUM_THREADS``, recorded in ``threads``),
    and wait for all; wall seconds of each."""
    share = str(max(1, (os.cpu_count() or 1) // max(1, len(commands))))
    procs, t0, wall = {}, time.perf_counter(), {}
    for name, cmd in commands.items():
        print(f"{name}: {' '.join(cmd)} ({share} threads)", flush=True)
        env = {**os.environ, "OMP_NUM_THREADS": share, "PYTHONPATH": str(ROOT)}
        threads[name] = int(share)
        with logs[name].open("w") as log:
            procs[name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    for name, proc in procs.items():
        if proc.wait() != 0:
            raise SystemExit(f"{name} failed (exit {proc.returncode}); see {logs[name]}")
        wall[name] = time.perf_counter() - t0
    return wall


def final_val(arm: str) -> float:
    """The committed 307k-token study arm's final validation loss."""
    return json.loads((STUDY_307K / "runs" / f"midtrain-smollm2-{arm}.json").read_text())["metrics"]["final_val_loss"]


def study_eval(arm: str) -> dict:
    """The committed 307k-token study arm's final zero-shot eval."""
    return json.loads((STUDY_307K / "eval" / f"midtrain-smollm2-{arm}.final.json").read_text())


def run_jobs(commands: dict[str, list[str]], jobs: int, logs: dict[str, Path], threads: dict[str, int]) -> dict[str, float]:
    """``commands`` side by side (``jobs`` 2) or one after the other (1); wall seconds of each."""
    wall = {}
    for group in [commands] if jobs == 2 else [{a: c} for a, c in commands.items()]:
        wall.update(run_side_by_side(group, logs, threads))
    return wall


def val_curve(run: Path) -> list[tuple[int, float]]:
    """``(step, val_loss)`` at every evaluation point of the run."""
    out = []
    for line in (run / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "val_loss" in rec:
            out.append((rec["step"], rec["val_loss"]))
    return out


def gap_to(curves: dict[str, list[tuple[int, float]]], arm: str, base: str = "dense") -> list[tuple[int, float]]:
    """``(step, arm's val_loss − base's)`` at every evaluation point both runs share."""
    return [(s, a - b) for (s, b), (_, a) in zip(curves[base], curves[arm])]


def paired_text(rows: list[dict]) -> str:
    """Paired differences (``stemlm.eval.run.paired`` rows) as ``task +d [low, high]`` in points."""
    return ", ".join(f"{r['task']} {100 * r['diff']:+.1f} [{100 * r['low']:+.1f}, {100 * r['high']:+.1f}]" for r in rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300, help="training steps of 8 x 256 tokens (default 300)")
    ap.add_argument("--study", type=Path, default=ROOT / "runs" / "study" / "midtrain-300k",
                    help="the midtrain-300k study's directory: its data/ and convert/ (default runs/study/midtrain-300k)")
    ap.add_argument("--runs", type=Path, default=ROOT / "runs" / "midtrain-longer",
                    help="where the two runs, their logs and evals go (default runs/midtrain-longer)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="training dtype")
    ap.add_argument("--jobs", type=int, default=2, choices=[1, 2],
                    help="2: the arms (and the evals) side by side, one thread each (default); 1: one after the other")
    ap.add_argument("--limit", type=int, default=500, help="items per task (default 500, the study's)")
    ap.add_argument("--tasks", default="arc_easy,piqa,hellaswag", help="zero-shot tasks (default the study's)")
    ap.add_argument("--note", default="", help="how the runs were made, if not by this script (kept in the JSON)")
    ap.add_argument("--kd-from-continued", action="store_true",
                    help="also train and score the arm taught by dense continued (see above)")
    args = ap.parse_args()
    for need in (args.study / "data" / "smollm2" / "corpus", args.study / "convert" / DENSE_MODEL,
                 args.study / "convert" / STEM_MODEL):
        if not need.exists():
            raise SystemExit(f"missing {need}: run `stemlm study run --spec midtrain-300k --stages midtrain` first")
    args.runs.mkdir(parents=True, exist_ok=True)
    stemlm = [sys.executable, "-m", "stemlm"]
    arms = train_args(args.study, args.steps, args.dtype)
    threads: dict[str, int] = {}  # each run's OMP_NUM_THREADS

    todo = {a: train_command(stemlm, o, args.runs / a) for a, o in arms.items() if finished(args.runs / a, args.steps) is None}
    train_wall = run_jobs(todo, args.jobs, {a: args.runs / f"{a}.log" for a in todo}, threads)
    summaries = {a: finished(args.runs / a, args.steps) for a in arms}
    if args.kd_from_continued:  # taught by the dense arm just finished: it trains after it, with every thread
        arm = "distilled-kd-continued"
        arms[arm] = kd_from_continued_args(args.study, args.steps, args.dtype, summaries["dense"]["checkpoint"])
        if finished(args.runs / arm, args.steps) is None:
            train_wall.update(run_jobs({arm: train_command(stemlm, arms[arm], args.runs / arm)}, 1,
                                       {arm: args.runs / f"{arm}.log"}, threads))
        summaries[arm] = finished(args.runs / arm, args.steps)

    evals = {a: args.runs / f"{a}.eval.json" for a in arms}
    todo = {a: [*stemlm, "eval", "--ckpt", summaries[a]["checkpoint"], "--tasks", args.tasks, "--limit",
                str(args.limit), "--output", str(evals[a]), "--no-progress"]
            for a in arms if not evals[a].is_file()}
    eval_threads: dict[str, int] = {}
    eval_wall = run_jobs(todo, args.jobs, {a: args.runs / f"{a}.eval.log" for a in todo}, eval_threads)

    from stemlm.eval.run import paired

    docs = {a: json.loads(p.read_text()) for a, p in evals.items()}
    pairs = paired([docs["dense"], docs["distilled-kd-linear"]])
    curves = {a: val_curve(args.runs / a) for a in arms}
    gap = gap_to(curves, "distilled-kd-linear")
    acc = {a: {t: r["acc"] for t, r in d["tasks"].items()} for a, d in docs.items()}
    before = json.loads((STUDY_307K / "zero_shot_paired.json").read_text())
    at_307k = {"dense": before["result"], "distilled-kd-linear": study_eval("stem-distilled-kd-linear")["result"]}
    longer_minus_307k = {a: paired([at_307k[a], docs[a]]) for a in at_307k}  # each arm against itself at 307k tokens
    continued = {}
    if "distilled-kd-continued" in arms:
        kdc = "distilled-kd-continued"
        continued = {"val_gap": gap_to(curves, kdc),
                     "paired_minus_dense": paired([docs["dense"], docs[kdc]]),
                     "paired_minus_kd_linear": paired([docs["distilled-kd-linear"], docs[kdc]])}
        for name in ("paired_minus_dense", "paired_minus_kd_linear"):
            print(f"{kdc} {name}: {paired_text(continued[name])}")
        print(f"{kdc}: final validation gap {continued['val_gap'][-1][1]:+.4f} nats")
    for row in pairs:
        print(f"{row['task']}: distilled - dense {100 * row['diff']:+.1f} points "
              f"[{100 * row['low']:+.1f}, {100 * row['high']:+.1f}]")
    for a, rows in longer_minus_307k.items():
        print(f"{a}, {args.steps} steps - 150 steps: {paired_text(rows)}")
    print(f"final validation gap {gap[-1][1]:+.4f} nats at step {gap[-1][0]}")
    path = write_result(f"midtrain_longer_{args.steps * 8 * 256 // 1000}k", False, {
        "what": (f"dense continued vs the locally distilled STEM-1/3 KD-linear arm of studies/midtrain-300k.yaml, "
                 f"{args.steps} steps x 8 x 256 = {args.steps * 2048:,} tokens, {args.dtype}, then zero-shot "
                 f"({args.tasks}, {args.limit} items, fp32) paired item by item"),
        "command": " ".join(["python benchmarks/midtrain_longer.py", f"--steps {args.steps}", f"--jobs {args.jobs}",
                             f"--dtype {args.dtype}"] + (["--kd-from-continued"] if args.kd_from_continued else [])),
        "train_commands": {a: "stemlm train " + " ".join(o) for a, o in arms.items()},
        "note": args.note, "train_threads": threads, "eval_threads": eval_threads, "train_wall_s": train_wall,
        "eval_wall_s": eval_wall,
        "summaries": summaries, "val_curves": curves, "val_gap": gap, "zero_shot_acc": acc,
        "paired_distilled_minus_dense": pairs,
        "paired_against_itself_at_307k": longer_minus_307k,
        "kd_from_continued": continued,
        "at_307k": {"val_gap": final_val("stem-distilled-kd-linear") - final_val("dense"),
                    "zero_shot_acc": {a: {t: r["acc"] for t, r in study_eval(a)["result"]["tasks"].items()}
                                      for a in ("dense", "stem-distilled-kd-linear")},
                    "paired_distilled_minus_dense": before["paired_with_stem_distilled_kd_linear"],
                    "source": "results/study/midtrain-300k (fp32, 150 steps; dense continued's per-item eval is "
                              "zero_shot_paired.json's re-trained run)"},
        "evals": docs})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
