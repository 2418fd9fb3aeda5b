"""`stemlm train` / `python -m stemlm.train` / `stemlm eval-ppl`, and recovery from SIGKILL."""

import os
import random
import signal
import subprocess
import sys
import time

import pytest
from train_helpers import losses, make_token_data, one_thread  # noqa: F401

from stemlm.cli import main
from stemlm.train.state import list_checkpoints

QUIET = ["run.peak_flops=1e11", "run.progress=false", "run.plots=false"]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return make_token_data(tmp_path_factory.mktemp("data"))


def test_help_documents_every_section(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = capsys.readouterr().out
    for key in ("--resume", "--compare", "model.preset", "model.FIELD", "data.seq_len", "optim.table_optimizer",
                "optim.table_lr", "run.ckpt_every", "run.init_from"):
        assert key in text, key


def test_train_compare_and_eval_ppl(data_dir, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "--preset", "debug", "--data", str(data_dir), "--out", str(out), "--steps", "6",
                 "--compare", "dense", *QUIET, "run.plots=true"]) == 0
    text = capsys.readouterr().out
    assert "unigram entropy" in text and "stem: val loss" in text and "dense: val loss" in text
    assert (out / "compare_loss_vs_tokens.png").exists() and (out / "loss_vs_flops.png").exists()
    assert list_checkpoints(out) and list_checkpoints(tmp_path / "run-dense")
    assert main(["eval-ppl", "--ckpt", str(out), "--batches", "2"]) == 0
    assert "perplexity" in capsys.readouterr().out
    assert main(["eval-ppl", "--ckpt", str(tmp_path / "missing")]) == 2
    assert main(["train", "--preset", "debug", "--data", str(data_dir), "--out", str(out), *QUIET]) == 1
    assert "--resume" in capsys.readouterr().err


def test_bad_override_is_a_one_line_error(data_dir, tmp_path, capsys):
    assert main(["train", "--preset", "debug", "--data", str(data_dir), "--out", str(tmp_path), "optim.nope=1"]) == 2
    assert "unknown config field" in capsys.readouterr().err


def test_train_on_raw_text_prepares_it_once(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("STEMLM_CACHE", str(tmp_path / "cache"))
    raw = tmp_path / "notes"
    raw.mkdir()
    for i in range(40):
        (raw / f"note{i}.txt").write_text(f"Note {i}. The river flows past the old mill and the bridge. " * 3)
    out = tmp_path / "run"
    args = ["train", "--preset", "debug", "--data", str(raw), "--out", str(out), *QUIET, "model.vocab_size=300"]
    assert main([*args, "--steps", "2"]) == 0
    (prepared,) = (tmp_path / "cache" / "data").iterdir()
    assert prepared.name.startswith("user-") and prepared.name.endswith("-v300") and (prepared / "COMPLETE").exists()
    assert f"dir: {prepared}" in (out / "config.yaml").read_text()  # the run names the prepared dir
    mtime = (prepared / "train.bin").stat().st_mtime_ns
    assert main([*args, "--steps", "3", "--resume"]) == 0  # same text: same dir, reused; resume accepts it
    assert (prepared / "train.bin").stat().st_mtime_ns == mtime and len(list((tmp_path / "cache" / "data").iterdir())) == 1
    (prepared / "meta.json").unlink()  # a damaged prepared dir is reported as one, not re-read as raw text
    assert main(["train", "--preset", "debug", "--data", str(prepared), "--out", str(tmp_path / "r2"), *QUIET]) == 2
    assert "not a prepared data dir" in capsys.readouterr().err


def _command(data_dir, out, *extra):
    return [sys.executable, "-m", "stemlm.train", "--preset", "debug", "--data", str(data_dir), "--out", str(out),
            *QUIET, *extra]


def _kill_and_resume(data_dir, tmp_path, args, kills: int, seed: int):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # as the in-process reference run (one_thread fixture)
    assert main(["train", *_command(data_dir, tmp_path / "full", *args)[3:]]) == 0
    rng, out = random.Random(seed), tmp_path / "killed"
    for k in range(kills):
        proc = subprocess.Popen(_command(data_dir, out, *args, *(["--resume"] if k else [])), env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        n_before = len(list_checkpoints(out))
        deadline = time.time() + 120
        while len(list_checkpoints(out)) <= n_before and proc.poll() is None and time.time() < deadline:
            time.sleep(0.01)
        time.sleep(rng.uniform(0, 0.4))  # a random moment after a new checkpoint: maybe mid-write
        proc.kill()
        assert proc.wait() == -signal.SIGKILL, "the run ended before it could be killed; give it more steps"
    subprocess.run(_command(data_dir, out, *args, "--resume"), check=True, env=env, capture_output=True)
    assert losses(out) == losses(tmp_path / "full")


def test_sigkill_then_resume_equals_uninterrupted(data_dir, tmp_path):
    _kill_and_resume(data_dir, tmp_path, ["run.steps=150", "run.ckpt_every=5", "run.eval_every=0"], kills=1, seed=0)


@pytest.mark.slow
@pytest.mark.parametrize("table_optimizer", ["sparse", "dense"])
def test_repeated_sigkill_then_resume_equals_uninterrupted(data_dir, tmp_path, table_optimizer):
    args = ["run.steps=600", "run.ckpt_every=7", "run.eval_every=20", "optim.grad_accum=2",
            f"optim.table_optimizer={table_optimizer}"]
    _kill_and_resume(data_dir, tmp_path, args, kills=4, seed=int(time.time()))
