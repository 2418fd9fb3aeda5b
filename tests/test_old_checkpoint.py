"""A checkpoint written by the code before the refactors of issues 33 and 35 (tree 5de0d63, committed as
a fixture: a debug STEM-1/2 model after 2 training steps) still loads: weights through the one loader
with its manifest verified, the same logits as when it was written, and its optimizer state into both
table paths' optimizers; the run directory rule resolves it."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from stemlm.checkpoint.rundir import RunDir, resolve_checkpoint
from stemlm.store import Placement, open_model
from stemlm.train import state as ckpt_io
from stemlm.train.config import config_from_yaml_text
from stemlm.train.fused import install_fused_tables
from stemlm.train.optim import build_optimizers

FIXTURE = Path(__file__).parent / "fixtures" / "checkpoint_5de0d63"
EXPECT = json.loads((FIXTURE.parent / "checkpoint_5de0d63.json").read_text())


@pytest.mark.parametrize("tier", ["device", "host"])
def test_old_checkpoint_loads_with_the_logits_it_had(tier):
    model = open_model(FIXTURE, Placement(tier))
    with torch.no_grad():
        logits = model(torch.tensor(EXPECT["ids"]))
    torch.testing.assert_close(logits[0, 0, :8], torch.tensor(EXPECT["logits_first"]), rtol=1e-5, atol=1e-6)
    assert float(logits.double().sum()) == pytest.approx(EXPECT["logits_sum"], rel=1e-6)


@pytest.mark.parametrize("fused", [False, True])
def test_old_optimizer_state_loads_into_both_table_paths(fused):
    cfg = config_from_yaml_text((FIXTURE / ckpt_io.RUN_CONFIG).read_text())
    model = open_model(FIXTURE).train()
    if fused:
        install_fused_tables(model)
    opt, table_opt = build_optimizers(model, cfg.optim)
    ckpt_io.load_optimizer_state(FIXTURE, opt, table_opt)
    assert table_opt.global_step == 2 and ckpt_io.read_trainer_state(FIXTURE)["step"] == 2


def test_a_run_dir_around_it_resolves_to_it(tmp_path):
    run = RunDir(tmp_path / "run")
    shutil.copytree(FIXTURE, run.checkpoint(2))
    assert resolve_checkpoint(run.path) == run.checkpoint(2) == run.newest_good()
