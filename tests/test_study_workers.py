"""Several processes sharing one study: claim files, stale claims, `study run --jobs 2`."""

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml
from train_helpers import make_token_data, one_thread  # noqa: F401

from stemlm.cli import main
from stemlm.study import Study, load_spec
from stemlm.study.workers import RunClaims


def test_a_claim_is_exclusive_and_a_dead_process_claim_is_taken_over(tmp_path):
    mine, other = RunClaims(tmp_path), RunClaims(tmp_path)
    assert mine.take("run-a") and mine.take("run-a")  # taking one's own claim again is fine
    assert not other.take("run-a")
    mine.release("run-a")
    assert other.take("run-a") and not mine.take("run-a")

    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).resolve().parents[1])!r}); "
            f"from stemlm.study.workers import RunClaims; assert RunClaims({str(tmp_path)!r}).take('run-b')")
    dead = subprocess.run([sys.executable, "-c", code])  # claims run-b and exits without releasing it
    assert dead.returncode == 0 and mine.take("run-b")


def test_two_workers_train_every_run_once_with_the_sequential_losses(tmp_path, capsys):
    data = make_token_data(tmp_path / "data")
    spec = {"name": "ci", "data_dir": str(data), "optim": "paper",
            "train": ["run.peak_flops=1e11", "run.eval_every=2", "run.eval_batches=2", "run.ckpt_every=4"],
            "sizes": {"d64": {"preset": "debug"}}, "budget": {"steps": 6, "batch_size": 4, "seq_len": 32},
            "sweep": {"size": "d64", "seeds": [0], "steps": 3, "lrs": [3e-3, 3e-2], "variants": ["dense", "stem-1/3"]},
            "compare": {"sizes": ["d64"], "seeds": [0, 1], "variants": ["dense", "stem-1/3"]}}
    (path := tmp_path / "ci.yaml").write_text(yaml.safe_dump(spec))
    common = ["--spec", str(path), "--skip-eval", "--no-report"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "stemlm", "study", "run", *common, "--jobs", "2",
           "--results", str(tmp_path / "par"), "--scratch", str(tmp_path / "par-scratch")]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "2 workers, 1 thread(s) each" in done.stderr and "runs trained by 2 workers" in done.stdout
    trained = [line.split(": ")[1] for line in done.stderr.splitlines() if line.endswith(": training")]
    assert len(trained) == len(set(trained)) == 8, done.stderr[-4000:]  # 4 sweep + 4 comparison runs, none twice

    assert main(["study", "run", *common, "--results", str(tmp_path / "seq"), "--scratch", str(tmp_path / "seq-scratch")]) == 0
    assert "8 runs trained" in capsys.readouterr().out
    study = Study(load_spec(str(path)), tmp_path / "seq", tmp_path / "seq-scratch", log=lambda m: None)
    for run in study.runs:
        par = json.loads((tmp_path / "par" / "runs" / f"{run.name}.json").read_text())
        seq = json.loads((tmp_path / "seq" / "runs" / f"{run.name}.json").read_text())
        assert par["spec_hash"] == seq["spec_hash"]
        no_wall = lambda rows: [[r[0], r[1], *r[3:]] for r in rows]  # noqa: E731  (step, loss, _, grad norm, lr)
        assert no_wall(par["metrics"]["train"]) == no_wall(seq["metrics"]["train"]), run.name  # same seed, same losses
        assert par["metrics"]["final_val_loss"] == seq["metrics"]["final_val_loss"], run.name
        steps = [json.loads(x)["step"] for x in (Path(par["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
        assert steps == sorted(set(steps)), run.name  # no step trained twice
    keys = [p.name for p in (tmp_path / "par-scratch" / "claims").iterdir()]
    free = RunClaims(tmp_path / "par-scratch")
    assert len(keys) == 8 and all(free.take(k) for k in keys)  # every claim released


def test_jobs_must_be_positive(tmp_path, capsys):
    assert main(["study", "run", "--quick", "--jobs", "0", "--results", str(tmp_path / "r")]) != 0
    assert "--jobs must be >= 1, got 0" in capsys.readouterr().err
