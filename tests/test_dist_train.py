"""torchrun with 2 CPU processes (gloo; DDP or FSDP2 backbone; sharded tables) equals 1 process."""

import json
import math
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from train_helpers import make_token_data

from stemlm.checkpoint.integrity import write_manifest

STEPS, TOKENS_PER_STEP = 5, 8 * 128  # data.batch_size=8 sequences of the debug preset's 128 tokens
TABLE_PEAK_LR = 3e-2  # the largest learning rate of the run (tables: 10 x the backbone's 3e-3)
ARGS = ["--preset", "debug", "--steps", str(STEPS), "run.peak_flops=1e11", "run.progress=false", "run.plots=false",
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


def assert_losses_match(one, two):
    """Losses of runs that differ only in the order of fp32 sums.

    A mean over N tokens summed in another order differs by about log2(N) roundings of the
    loss's size; a factor 4 covers the all-reduce and the weights' own rounding drift."""
    assert len(one) == len(two) == STEPS
    tol = 4 * math.ceil(math.log2(TOKENS_PER_STEP)) * torch.finfo(torch.float32).eps * max(one)
    assert max(abs(a - b) for a, b in zip(one, two)) <= tol


def assert_weights_match(a: dict, b: dict):
    """Weights after the same steps with gradients summed in another order.

    Adam divides each gradient by its own running size, so an element whose gradient is a
    near-cancelling sum (size ~ rounding) can step differently by up to ~lr per step: no
    elementwise bound tighter than 2 * lr * steps holds. The bulk must agree: 99.9 % of
    elements within 1e-4 of the largest move one step can make.
    """
    assert a.keys() == b.keys()
    diff = torch.cat([(a[k].float() - b[k].float()).abs().flatten() for k in a])
    assert diff.max().item() <= 2 * TABLE_PEAK_LR * STEPS
    assert diff.quantile(0.999).item() <= 1e-4 * TABLE_PEAK_LR


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_token_data(tmp_path_factory.mktemp("data"))


def test_two_processes_match_one_and_resume(tmp_path, data):
    one = _run(data, tmp_path / "one", 1)
    two = _run(data, tmp_path / "two", 2)
    assert_losses_match(one, two)
    # checkpoints are world-size independent: the same files a 1-process run writes
    assert_weights_match(load_file(tmp_path / "one/checkpoints/step_00000005/model.safetensors"),
                         load_file(tmp_path / "two/checkpoints/step_00000005/model.safetensors"))
    # a distributed run paused at step 3 and resumed gives exactly the uninterrupted 2-process losses
    _run(data, tmp_path / "three", 2, "--stop-at", "3")
    # ... and every rank continues its own RNG stream: give the checkpoint distinct per-rank states
    ckpt = tmp_path / "three/checkpoints/step_00000003"
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert len(state["rng_ranks"]) == 2
    state["rng_ranks"] = [_seeded_rng_state(seed) for seed in (11, 12)]
    (ckpt / "trainer_state.json").write_text(json.dumps(state))
    write_manifest(ckpt)
    resumed = _run(data, tmp_path / "three", 2, "--resume")
    assert resumed == two
    # nothing in these steps draws random numbers: the states saved at step 5 are the ones restored
    final = json.loads((tmp_path / "three/checkpoints/step_00000005/trainer_state.json").read_text())
    assert final["rng_ranks"] == state["rng_ranks"] and final["rng"] == state["rng_ranks"][0]


def _seeded_rng_state(seed: int) -> dict:
    import random

    import numpy as np

    from stemlm.train.state import rng_state

    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)
    return json.loads(json.dumps(rng_state()))  # as stored (tuples become lists)


def test_fsdp_backbone_matches_one_process(tmp_path, data):
    one = _run(data, tmp_path / "one", 1)
    fsdp = _run(data, tmp_path / "fsdp", 2, "run.parallel=fsdp")
    assert_losses_match(one, fsdp)
    assert_weights_match(load_file(tmp_path / "one/checkpoints/step_00000005/model.safetensors"),
                         load_file(tmp_path / "fsdp/checkpoints/step_00000005/model.safetensors"))
    a = load_file(tmp_path / "one/checkpoints/step_00000005/optimizer.safetensors")
    b = load_file(tmp_path / "fsdp/checkpoints/step_00000005/optimizer.safetensors")
    # Adam's moments are running sums of gradients (and their squares): rounding-sized differences
    assert a.keys() == b.keys() and max((a[k].float() - b[k].float()).abs().max().item() for k in a) < 1e-6


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_compiled_blocks_under_two_processes_match_eager(tmp_path, data, parallel):
    one = _run(data, tmp_path / "one", 1)
    two = _run(data, tmp_path / "two", 2, "run.compile=true", f"run.parallel={parallel}")
    assert max(abs(a - b) for a, b in zip(one, two)) <= 1e-4
