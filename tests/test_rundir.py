"""``RunDir``: one layout and one "newest good checkpoint" rule for the trainer and every loader."""

import warnings

import pytest

from stemlm.checkpoint.integrity import CheckpointError
from stemlm.checkpoint.rundir import CheckpointWarning, RunDir, resolve_checkpoint
from stemlm.train.state import list_checkpoints, resume_checkpoint
from stemlm.train import train
from train_helpers import debug_config, make_token_data


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("rundir")
    out = root / "run"
    train(debug_config(make_token_data(root / "data"), out, "run.steps=4", "run.ckpt_every=2", "run.eval_every=0",
                       "run.keep_last=3"))
    return out


def test_layout_is_named_in_one_place(run):
    rd = RunDir(run)
    assert rd.checkpoints() == list_checkpoints(run) and [p.name for p in rd.checkpoints()] == ["step_00000002",
                                                                                               "step_00000004"]
    assert rd.checkpoint(4) == rd.checkpoints()[-1] and rd.metrics.exists() and rd.train_config.exists()
    assert rd.summary.exists() and rd.model_config.exists() and RunDir.holds_run(run)


def test_loaders_and_the_trainer_pick_the_same_newest_good_checkpoint(run, tmp_path):
    import shutil
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    assert resolve_checkpoint(copy) == RunDir(copy).checkpoint(4) == resume_checkpoint(copy)
    weights = RunDir(copy).checkpoint(4) / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-8] + b"\0" * 8)
    with pytest.warns(CheckpointWarning, match="step_00000004"):
        assert resolve_checkpoint(copy) == RunDir(copy).checkpoint(2)  # a loader skips it and moves nothing
    assert RunDir(copy).checkpoint(4).exists()
    assert resolve_checkpoint(copy, verify=False) == RunDir(copy).checkpoint(4)
    with pytest.warns(CheckpointWarning):
        assert resume_checkpoint(copy) == RunDir(copy).checkpoint(2)  # the trainer moves it aside
    assert not RunDir(copy).checkpoint(4).exists() and (copy / "checkpoints" / "corrupt-step_00000004").is_dir()
    older = RunDir(copy).checkpoint(2) / "model.safetensors"
    older.write_bytes(older.read_bytes()[:100])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CheckpointWarning)
        with pytest.raises(CheckpointError, match="no checkpoint of .* verifies .newest: corrupt checkpoint .*model.safetensors"):
            resolve_checkpoint(copy)
