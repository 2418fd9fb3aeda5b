"""Robustness check (not a timing): ``kill -9`` a training at random moments, resume, compare bit for bit.

A debug-preset run (sparse tables, grad accumulation, evaluations, checkpoints every few steps) is
trained once without interruption. The same run is then started and killed again and again,
each time resumed with ``--resume``:

* ``train``: killed at a random moment after it has trained at least one step;
* ``save``: killed inside a checkpoint save. The save window is widened for this with the
  test-only ``STEMLM_TEST_SAVE_PAUSE`` (seconds slept between the files of a save, see
  ``stemlm/checkpoint/directory.py``); the script waits for the save's temporary directory to appear, then
  kills at a random moment within the widened window;
* ``corrupt``: before the last resume, bytes in the newest checkpoint's weights are flipped; the
  resume must refuse it (warning naming it) and continue from the previous one.

Finally the run is resumed to the end. It passes when its per-step losses, validation losses,
final weights and optimizer state equal the uninterrupted run's exactly, every checkpoint left
verifies, no temporary directory is left and the run's lock is released. Writes
``results/robustness_kill_resume.json`` and prints a summary table.

    python benchmarks/robustness_kill_resume.py            # 20 kills while training, 20 inside saves
    python benchmarks/robustness_kill_resume.py --quick    # 2 + 2
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from _train_bench import synthetic_data_dir, write_result
from safetensors.torch import load_file

from stemlm.checkpoint.directory import SAVE_PAUSE_ENV, CheckpointError

from stemlm.store import open_model
from stemlm.checkpoint.integrity import verify_checkpoint
from stemlm.train.state import list_checkpoints

RUN_ARGS = ["--preset", "debug", "run.ckpt_every=10", "run.eval_every=25", "run.keep_last=2", "optim.grad_accum=2",
            "run.peak_flops=1e11", "run.progress=false", "run.plots=false"]
PAUSE = 0.25  # seconds per pause; a save pauses three times


def command(data: Path, out: Path, steps: int, resume: bool) -> list[str]:
    """The ``stemlm.train`` command line of the checked run."""
    return [sys.executable, "-m", "stemlm.train", *RUN_ARGS, "--steps", str(steps), "--data", str(data),
            "--out", str(out), *(["--resume"] if resume else [])]


def environment(pause: float = 0.0) -> dict:
    """One thread (as the reference run) and, for save kills, the test-only save pause."""
    return {**os.environ, "OMP_NUM_THREADS": "1", SAVE_PAUSE_ENV: str(pause) if pause else ""}


def metrics(out: Path) -> list[dict]:
    """The complete records of ``metrics.jsonl`` (a line being written is skipped)."""
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:  # the line being written
            pass
    return records


def saving(out: Path) -> list[Path]:
    """The temporary directories of checkpoint saves in progress."""
    root = out / "checkpoints"
    return sorted(root.glob(".step_*.tmp-*")) if root.is_dir() else []


def wait_for(condition, proc: subprocess.Popen, what: str, timeout: float = 300.0) -> None:
    """Poll ``condition`` every 5 ms; a clear error if the process ends or the time runs out first."""
    deadline = time.time() + timeout
    while not condition():
        if proc.poll() is not None:
            raise RuntimeError(f"the run ended (exit {proc.returncode}) before {what}; give it more --steps")
        if time.time() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.005)


def kill_once(data: Path, out: Path, steps: int, phase: str, rng: random.Random) -> dict:
    """Start (or resume) the run, kill it in ``phase``; what was killed where."""
    start = len(metrics(out))
    before = list_checkpoints(out)
    proc = subprocess.Popen(command(data, out, steps, resume=True), env=environment(PAUSE if phase == "save" else 0),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    if phase == "train":
        wait_for(lambda: len(metrics(out)) > start, proc, "its first step")
        delay = rng.uniform(0.0, 1.5)
    else:
        wait_for(lambda: bool(saving(out)), proc, "a checkpoint save")
        delay = rng.uniform(0.0, 3 * PAUSE)
    time.sleep(delay)
    inside_save = bool(saving(out))
    proc.send_signal(signal.SIGKILL)
    if proc.wait() != -signal.SIGKILL:
        raise RuntimeError(f"the run ended (exit {proc.returncode}) before it was killed; give it more --steps")
    records, after = metrics(out), list_checkpoints(out)
    return {"phase": phase, "delay_s": round(delay, 3), "resumed_from": before[-1].name if before else None,
            "killed_at_step": records[-1]["step"] if records else 0, "inside_save": inside_save,
            "checkpoints_left": [p.name for p in after],
            "steps_lost": (records[-1]["step"] if records else 0) - (_step(after[-1]) if after else 0)}


def _step(ckpt: Path) -> int:
    return int(ckpt.name.split("_")[-1])


def flip_newest(out: Path) -> dict:
    """Flip bytes in the newest checkpoint's weights; check that loading refuses it."""
    newest = list_checkpoints(out)[-1]
    weights = newest / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF
    weights.write_bytes(bytes(data))
    try:
        open_model(newest)
        refused = False
    except CheckpointError:
        refused = True
    return {"corrupted": newest.name, "refused_by_load_model": refused}


def compare(ref: Path, out: Path) -> dict:
    """Exact equality of losses, val losses, final weights and optimizer state; leftovers."""
    a, b = metrics(ref), metrics(out)
    same_losses = [r["loss"] for r in a] == [r["loss"] for r in b]
    same_val = [r.get("val_loss") for r in a] == [r.get("val_loss") for r in b]
    last_a, last_b = list_checkpoints(ref)[-1], list_checkpoints(out)[-1]
    exact = {}
    for name in ("model.safetensors", "optimizer.safetensors"):
        ta, tb = load_file(str(last_a / name)), load_file(str(last_b / name))
        exact[name] = ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)
    verified = all(verify_checkpoint(c) for c in list_checkpoints(out))
    leftovers = [p.name for p in (out / "checkpoints").iterdir() if p.name.startswith(".")]
    return {"steps": len(b), "losses_equal": same_losses, "val_losses_equal": same_val,
            "weights_equal": exact["model.safetensors"], "optimizer_equal": exact["optimizer.safetensors"],
            "checkpoints_verify": verified, "leftover_temp_dirs": leftovers,
            "lock_released": (out / "train.lock").read_text() == ""}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kills", type=int, default=20, help="kills per phase (train, save) (default: 20)")
    parser.add_argument("--steps", type=int, default=1000, help="optimizer steps of the run (default: 1000)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the kill moments (default: 0)")
    parser.add_argument("--quick", action="store_true", help="2 kills per phase, 200 steps (a smoke run)")
    args = parser.parse_args()
    kills, steps = (2, 200) if args.quick else (args.kills, args.steps)
    data = synthetic_data_dir(512, 100_000)
    work = Path(tempfile.mkdtemp(prefix="stemlm-kill-resume-"))
    try:
        ref, out = work / "uninterrupted", work / "killed"
        subprocess.run(command(data, ref, steps, resume=False), env=environment(), check=True, capture_output=True)
        rng = random.Random(args.seed)
        phases = ["train"] * kills + ["save"] * kills
        rng.shuffle(phases)
        events = [kill_once(data, out, steps, phase, rng) for phase in phases]
        corrupt = flip_newest(out)
        final = subprocess.run(command(data, out, steps, resume=True), env=environment(), capture_output=True, text=True)
        corrupt["resume_exit"] = final.returncode
        corrupt["warned"] = f"skipping damaged checkpoint {corrupt['corrupted']}" in final.stderr
        corrupt["moved_aside"] = (out / "checkpoints" / f"corrupt-{corrupt['corrupted']}").is_dir()
        result = compare(ref, out) if final.returncode == 0 else {"error": final.stderr[-2000:]}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    by_phase = {p: [e for e in events if e["phase"] == p] for p in ("train", "save")}
    ok = (result.get("losses_equal") and result.get("val_losses_equal") and result.get("weights_equal")
          and result.get("optimizer_equal") and result.get("checkpoints_verify") and not result.get("leftover_temp_dirs")
          and result.get("lock_released") and corrupt["refused_by_load_model"] and corrupt["warned"]
          and corrupt["moved_aside"])
    path = write_result("robustness_kill_resume", args.quick, {
        "run_args": RUN_ARGS, "steps": steps, "kills_per_phase": kills, "seed": args.seed, "save_pause_s": PAUSE,
        "events": events, "corrupt_case": corrupt, "final": result, "passed": bool(ok)})
    print(f"{'phase':<8} {'kills':>5} {'inside a save':>13} {'steps lost':>10}")
    for phase, evs in by_phase.items():
        print(f"{phase:<8} {len(evs):>5} {sum(e['inside_save'] for e in evs):>13} {sum(e['steps_lost'] for e in evs):>10}")
    print(f"corrupt newest checkpoint {corrupt['corrupted']}: refused by load_model {corrupt['refused_by_load_model']}, "
          f"skipped on resume {corrupt['warned']}, moved aside {corrupt['moved_aside']}")
    for key, value in result.items():
        print(f"  {key}: {value}")
    print(f"{'PASSED' if ok else 'FAILED'}: resumed run equals the uninterrupted one bit for bit; wrote {path}")
    if not ok:
        sys.exit(1)


if __name__ == "__main__":
    main()
