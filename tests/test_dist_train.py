"""torchrun with 2 CPU processes (gloo; DDP or FSDP2 backbone; sharded tables) equals 1 process."""

import json
import os
import subprocess
import sys

import pytest
from safetensors.torch import load_file

from train_helpers import make_token_data

ARGS = ["--preset", "debug", "--steps", "5", "run.peak_flops=1e11", "run.progress=false", "run.plots=false",
        "run.eval_every=0", "data.batch_size=8", "run.ckpt_every=3"]


def _run(data, out, nproc, *extra):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if nproc == 1:
        cmd = [sys.executable, "-m", "stemlm.train"]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", "-m", "stemlm.train"]
    proc = subprocess.run(cmd + ARGS + ["--data", str(data), "--out", str(out), *extra], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (f"{' '.join(cmd[-3:])} exited {proc.returncode}\n--- stdout (tail)\n{proc.stdout[-1500:]}"
                                  f"\n--- stderr (tail)\n{proc.stderr[-6000:]}")
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_token_data(tmp_path_factory.mktemp("data"))


def test_two_processes_match_one_and_resume(tmp_path, data):
    one = _run(data, tmp_path / "one", 1)
    two = _run(data, tmp_path / "two", 2)
    assert len(one) == len(two) == 5
    assert max(abs(a - b) for a, b in zip(one, two)) <= 1e-5
    # checkpoints are world-size independent: the same files a 1-process run writes
    a = load_file(tmp_path / "one/checkpoints/step_00000005/model.safetensors")
    b = load_file(tmp_path / "two/checkpoints/step_00000005/model.safetensors")
    assert a.keys() == b.keys() and max((a[k] - b[k]).abs().max().item() for k in a) < 1e-5
    # a distributed run paused at step 3 and resumed gives the same losses
    _run(data, tmp_path / "three", 2, "--stop-at", "3")
    resumed = _run(data, tmp_path / "three", 2, "--resume")
    assert max(abs(a - b) for a, b in zip(one, resumed)) <= 1e-5


def test_fsdp_backbone_matches_one_process(tmp_path, data):
    one = _run(data, tmp_path / "one", 1)
    fsdp = _run(data, tmp_path / "fsdp", 2, "run.parallel=fsdp")
    assert max(abs(a - b) for a, b in zip(one, fsdp)) <= 1e-5
    a = load_file(tmp_path / "one/checkpoints/step_00000005/optimizer.safetensors")
    b = load_file(tmp_path / "fsdp/checkpoints/step_00000005/optimizer.safetensors")
    assert a.keys() == b.keys() and max((a[k].float() - b[k].float()).abs().max().item() for k in a) < 1e-6


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_compiled_blocks_under_two_processes_match_eager(tmp_path, data, parallel):
    one = _run(data, tmp_path / "one", 1)
    two = _run(data, tmp_path / "two", 2, "run.compile=true", f"run.parallel={parallel}")
    assert max(abs(a - b) for a, b in zip(one, two)) <= 1e-4
