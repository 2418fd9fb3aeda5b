"""Runs that cannot silently go bad: no NaN checkpoints, checksummed checkpoints with fallback,
named config changes on resume, one writer per run dir, tidy interrupted saves."""

import json
import os
import shlex
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import save_file
from train_helpers import debug_config, losses, make_token_data, one_thread  # noqa: F401

from stemlm.checkpoint.directory import CheckpointError, model_state_for_save

from stemlm.store import open_model
from stemlm.cli import main
from stemlm.config import ConfigError
from stemlm.data.tokenizer import train_bpe
from stemlm.checkpoint.integrity import write_manifest
from stemlm.train import Trainer, TrainingDiverged, train
from stemlm.train.lock import RunLocked
from stemlm.train.state import CheckpointWarning, list_checkpoints

QUIET = ["run.peak_flops=1e11", "run.progress=false", "run.plots=false"]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return make_token_data(tmp_path_factory.mktemp("data"))


def _flip(path, at: int = -100):
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


def test_non_finite_weights_are_never_saved_and_never_loaded(data_dir, tmp_path, capsys):
    # lr 1e39 is inf in fp32: the first update makes the weights non-finite while loss and gradient are finite
    with pytest.raises(TrainingDiverged, match=r"NaN/inf.*at step 1; the weights were updated; no checkpoint"):
        train(debug_config(data_dir, tmp_path / "inf", "run.steps=4", "run.ckpt_every=1", "optim.lr=1e39",
                           "optim.warmup_ratio=0"))
    assert list_checkpoints(tmp_path / "inf") == []
    # a NaN checkpoint written by other means (an older version) is refused by every loader, in one line
    train(debug_config(data_dir, tmp_path / "run", "run.steps=2"))
    ckpt = list_checkpoints(tmp_path / "run")[-1]
    state = model_state_for_save(open_model(ckpt))
    save_file({k: torch.full_like(v, float("nan")) for k, v in state.items()}, str(ckpt / "model.safetensors"))
    write_manifest(ckpt)
    with pytest.raises(CheckpointError, match="NaN/inf"):
        open_model(ckpt)
    train_bpe(["the capital of France is Paris"] * 20, vocab_size=300).save(str(tmp_path / "tokenizer.json"))
    capsys.readouterr()
    for argv in (["eval-ppl", "--ckpt", str(tmp_path / "run")],
                 ["generate", "--ckpt", str(ckpt), "--prompt", "hi", "--tokenizer", str(tmp_path), "--tables", "disk"],
                 ["generate", "--ckpt", str(ckpt), "--prompt", "hi", "--tokenizer", str(tmp_path), "--tables", "host"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "NaN/inf" in err and len(err.strip().splitlines()) == 1, err


def test_divergence_advice_resumes_with_the_named_change(data_dir, tmp_path, capsys):
    out = tmp_path / "run"
    args = ["train", "--preset", "debug", "--data", str(data_dir), "--out", str(out), "--steps", "20", *QUIET,
            "run.ckpt_every=5", "optim.warmup_ratio=0", "optim.lr=150.0"]
    capsys.readouterr()
    assert main(args) == 1  # lr 150 diverges at step 10 on this data; lr 15 from step 5 does not
    err = capsys.readouterr().err
    assert "at step 10" in err and "step_00000005 is intact" in err and len(err.strip().splitlines()) == 1
    advice = err.split("Resume with a lower learning rate: ")[1].split(" (or")[0]
    assert advice == (f"stemlm train --config {out / 'config.yaml'} --resume --allow-change optim.lr optim.lr=15")
    # an unnamed change is refused, naming the field and the flag that would allow it
    with pytest.raises(ConfigError, match=r"optim.lr: 150.0 -> 15.0.*--allow-change optim.lr"):
        train(debug_config(data_dir, out, "run.steps=20", "run.ckpt_every=5", "optim.warmup_ratio=0", "optim.lr=15.0"),
              resume=True)
    with pytest.raises(ConfigError, match="model.* fields cannot change"):
        train(debug_config(data_dir, out, "run.steps=20"), resume=True, allow_changes=("model.d_model",))
    assert main(shlex.split(advice)[1:]) == 0  # the exact advice, as printed
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 21))
    change = [{"step": 5, "field": "optim.lr", "old": 150.0, "new": 15}]
    assert records[5]["config_changes"] == change and all("config_changes" not in r for r in records[6:])
    assert records[5]["lr"] <= 15 < records[4]["lr"]
    final = list_checkpoints(out)[-1]
    assert json.loads((final / "trainer_state.json").read_text())["config_changes"] == change
    for yaml_file in (out / "config.yaml", final / "config.yaml"):
        assert "# changed on resume at step 5: optim.lr 150.0 -> 15" in yaml_file.read_text()


def test_corrupt_checkpoint_is_refused_and_the_previous_one_resumed(data_dir, tmp_path):
    args = ("run.steps=12", "run.ckpt_every=4", "run.eval_every=0")
    train(debug_config(data_dir, tmp_path / "full", *args))
    out = tmp_path / "split"
    train(debug_config(data_dir, out, *args), stop_at=8)
    good, bad = list_checkpoints(out)
    _flip(bad / "model.safetensors")
    with pytest.raises(CheckpointError, match="model.safetensors does not match its sha256"):
        open_model(bad)
    open_model(bad, verify=False)  # flipped bytes in a weight load silently without the manifest
    with pytest.warns(CheckpointWarning, match="step_00000008"):
        train(debug_config(data_dir, out, *args), resume=True)
    assert losses(out) == losses(tmp_path / "full")
    a, b = open_model(tmp_path / "full").state_dict(), open_model(out).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert (out / "checkpoints" / "corrupt-step_00000008").is_dir()  # kept aside for inspection
    assert [p.name for p in list_checkpoints(out)] == ["step_00000008", "step_00000012"]


def test_truncated_files_are_one_line_errors(data_dir, tmp_path, capsys):
    out = tmp_path / "run"
    train(debug_config(data_dir, out, "run.steps=4", "run.ckpt_every=2", "run.eval_every=0"), stop_at=2)
    (ckpt,) = list_checkpoints(out)
    opt = ckpt / "optimizer.safetensors"
    opt.write_bytes(opt.read_bytes()[:50])
    with pytest.raises(CheckpointError, match="corrupt optimizer state"):
        train(debug_config(data_dir, out, "run.steps=4", "run.verify_checkpoints=false"), resume=True)
    with pytest.raises(CheckpointError, match="none verifies|no checkpoint of .* verifies"):
        with pytest.warns(CheckpointWarning):
            train(debug_config(data_dir, out, "run.steps=4"), resume=True)
    train(debug_config(data_dir, tmp_path / "w", "run.steps=2"))
    weights = list_checkpoints(tmp_path / "w")[-1] / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    capsys.readouterr()
    for extra in ([], ["--no-verify"]):
        assert main(["eval-ppl", "--ckpt", str(tmp_path / "w"), *extra]) == 2
        err = capsys.readouterr().err
        assert "corrupt" in err and len(err.strip().splitlines()) == 1, err


def test_interrupted_saves_are_tidied_and_a_replaced_checkpoint_restored(data_dir, tmp_path):
    out = tmp_path / "run"
    train(debug_config(data_dir, out, "run.steps=6", "run.ckpt_every=2"), stop_at=4)
    root = out / "checkpoints"
    (root / ".step_00000006.tmp-abc").mkdir()  # killed while writing
    (root / ".step_00000006.tmp-abc" / "model.safetensors").write_bytes(b"partial")
    os.replace(root / "step_00000004", root / ".step_00000004.old-123")  # killed between the two renames
    (root / ".step_00000002.del-9").mkdir()  # killed while deleting
    (out / ".metrics.jsonl.tmp-7").write_text("{")  # killed while trimming metrics.jsonl
    (out / ".notes.old-1").write_text("a user's file")  # not ours: left alone
    with Trainer(debug_config(data_dir, out, "run.steps=6", "run.ckpt_every=2"), resume=True) as trainer:
        assert trainer.step == 4
    assert sorted(p.name for p in root.iterdir()) == ["step_00000002", "step_00000004"]
    assert not (out / ".metrics.jsonl.tmp-7").exists() and (out / ".notes.old-1").exists()


def _train_cmd(data_dir, out, *extra):
    return [sys.executable, "-m", "stemlm.train", "--preset", "debug", "--data", str(data_dir), "--out", str(out),
            *QUIET, *extra]


def test_one_writer_per_run_dir(data_dir, tmp_path):
    out, env = tmp_path / "run", {**os.environ, "OMP_NUM_THREADS": "1"}
    first = subprocess.Popen(_train_cmd(data_dir, out, "--steps", "100000", "run.ckpt_every=1000"), env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 120
        while not (out / "metrics.jsonl").exists() and time.time() < deadline:  # training, lock held
            time.sleep(0.05)
        second = subprocess.run(_train_cmd(data_dir, out, "--steps", "3", "--resume"), env=env, capture_output=True,
                                text=True, timeout=120)
        assert second.returncode == 1
        assert second.stderr.strip() == (f"stemlm train: error: run dir {out} is in use by a training in pid "
                                         f"{first.pid}; wait for it to finish or choose another run.out")
    finally:
        first.kill()
    assert first.wait() == -signal.SIGKILL
    assert (out / "train.lock").read_text().strip() == str(first.pid)  # what kill -9 leaves behind
    with pytest.warns(UserWarning, match=f"taking over the lock of pid {first.pid}"):
        with Trainer(debug_config(data_dir, out, "run.steps=3")):
            with pytest.raises(RunLocked, match=f"pid {os.getpid()}"):  # also within one process
                Trainer(debug_config(data_dir, out, "run.steps=3"))
    assert (out / "train.lock").read_text() == ""  # released cleanly: nothing stale for the next one


def test_a_full_disk_while_saving_is_one_line_and_the_previous_checkpoint_is_kept(data_dir, tmp_path, capsys,
                                                                                   monkeypatch):
    import stemlm.train.state as state
    from safetensors import SafetensorError

    run = tmp_path / "run"
    args = ["train", "--preset", "debug", "--data", str(data_dir), "--out", str(run), "run.steps=4", "run.ckpt_every=2",
            *QUIET]
    real = state.save_file

    def full_disk_at_step_4(tensors, path):
        if "step_00000004" in path:  # what safetensors raises when the disk fills up
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        return real(tensors, path)

    monkeypatch.setattr(state, "save_file", full_disk_at_step_4)
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "No space left on device" in err[0] and "step_00000004" in err[0], err
    assert [p.name for p in list_checkpoints(run)] == ["step_00000002"]
    assert not [p for p in (run / "checkpoints").iterdir() if p.name.startswith(".")]  # no half-written directory
    monkeypatch.setattr(state, "save_file", real)
    assert main([*args, "--resume"]) == 0  # continues from step 2
    assert [p.name for p in list_checkpoints(run)][-1] == "step_00000004"
