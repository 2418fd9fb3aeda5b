"""``benchmarks/gpu_midtrain.py --smoke``: the GPU mid-training driver on a random 3-layer Llama, on the CPU."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_smoke_run_trains_every_arm_in_lockstep(tmp_path):
    out = tmp_path / "gpu_midtrain.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path), "STEMLM_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_midtrain.py"), "--smoke", "--seeds", "0,1",
                           "--out", str(out), "--scratch", str(tmp_path / "scratch")],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["smoke"] and set(r["seeds"]) == {"0", "1"} and r["seeds_skipped"] == []
    for seed in r["seeds"].values():
        assert list(seed) == ["dense", "stem-calibrated", "stem-calibrated-kd", "stem-gradual"]
        tokens = {arm: o["tokens"] for arm, o in seed.items()}
        assert len(set(tokens.values())) == 1 and tokens["dense"] > 0  # every arm saw the same number of tokens
        assert [c[0] for c in seed["dense"]["curve"]] == [0, 2, 4]  # run.eval_every=2 of 4 steps, plus step 0
        # the blend starts as exactly the dense model; the calibrated one-shot conversion does not
        assert abs(seed["stem-gradual"]["init_loss"] - seed["dense"]["init_loss"]) < 1e-6
        assert seed["stem-calibrated"]["init_loss"] != seed["dense"]["init_loss"]
        # the distilled arm starts from the same conversion and trains on the same tokens, to another end
        assert seed["stem-calibrated-kd"]["init_loss"] == seed["stem-calibrated"]["init_loss"]
        assert seed["stem-calibrated-kd"]["final_loss"] != seed["stem-calibrated"]["final_loss"]
    s = r["summary"]["stem-calibrated"]
    assert len(s["final_gap_per_seed"]) == 2 and s["final_gap_sd"] is not None
    assert "stem-calibrated − dense" in proc.stdout


def test_arms_must_start_with_dense():
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_midtrain.py"), "--smoke", "--arms",
                           "stem-calibrated"], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "--arms must start with dense" in proc.stderr
