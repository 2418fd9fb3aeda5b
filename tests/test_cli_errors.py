"""Bad input to the real `stemlm` entry point: exit status 2, one line on stderr naming the problem,
nothing on stdout, no traceback, and the files of an existing run left byte for byte as they were."""

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from train_helpers import one_thread  # noqa: F401

from stemlm.cli import main
from stemlm.data import prepare_facts_corpus

QUIET = ["run.peak_flops=1e11", "run.progress=false", "run.plots=false"]
LONG_PROMPT = "Spain " * 400  # more tokens than the debug preset's max_seq_len (128)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A finished debug run on the facts corpus (it has a tokenizer), and broken files beside it."""
    root = tmp_path_factory.mktemp("cli_errors")
    data = prepare_facts_corpus(progress=False)
    torch.set_num_threads(1)
    assert main(["train", "--preset", "debug", "--data", str(data), "--out", str(root / "run"), "--steps", "4",
                 *QUIET]) == 0
    (ckpt,) = sorted((root / "run" / "checkpoints").iterdir())[-1:]
    (root / "garbage.yaml").write_text("model: {preset: debug\n  - ][\n")
    (root / "list.yaml").write_text("- 1\n- 2\n")
    shutil.copytree(ckpt, root / "garbage_ckpt")
    (root / "garbage_ckpt" / "config.yaml").write_text("run: [unclosed\n")
    shutil.copytree(ckpt, root / "trunc_ckpt")
    weights = root / "trunc_ckpt" / "model.safetensors"
    os.truncate(weights, weights.stat().st_size - 4096)
    from stemlm.store import export_tables
    tables = export_tables(ckpt, root / "tables.safetensors")
    os.truncate(tables, tables.stat().st_size - 4096)
    return {"run": root / "run", "ckpt": ckpt, "tmp": root, "data": data}


def _snapshot(run: Path) -> dict:
    return {str(p.relative_to(run)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(run.rglob("*")) if p.is_file()}


GPU = torch.cuda.is_available()
CASES = [  # (argv, words the one stderr line must hold); {run} {ckpt} {tmp} {data} are filled in
    # config values: type, finiteness, range
    (["train", "--out", "{run}", "--resume", "optim.lr=inf"], ["optim.lr", "inf", "finite"]),
    (["train", "--out", "{run}", "--resume", "optim.lr=nan"], ["optim.lr", "finite"]),
    (["train", "--out", "{run}", "--resume", "optim.eps=-1"], ["optim.eps", "positive"]),
    (["train", "--out", "{run}", "--resume", "run.steps=1.5"], ["run.steps", "1.5", "integer"]),
    (["train", "--out", "{run}", "--resume", "data.seed=abc"], ["data.seed", "'abc'", "integer"]),
    (["train", "--out", "{run}", "--resume", "data.seed=-3"], ["data.seed", ">= 0"]),
    (["train", "--out", "{run}", "--resume", "run.progress=2"], ["run.progress", "true or false"]),
    (["train", "--out", "{run}", "--resume", "optim.betas=[0.9,x]"], ["optim.betas[1]", "'x'"]),
    (["train", "--out", "{run}", "--resume", "model.d_model=6.5"], ["model.d_model", "6.5", "integer"]),
    (["train", "--out", "{run}", "--resume", "model.rope_theta=.inf"], ["model.rope_theta", "finite"]),
    (["train", "--out", "{run}", "--resume", "model.tie_embeddings=1"], ["model.tie_embeddings", "true or false"]),
    (["train", "--out", "{run}", "--resume", "model=3"], ["model", "mapping"]),
    (["train", "--out", "{run}", "--resume", "--stem-layers", ""], ["--stem-layers", "empty"]),
    (["train", "--out", "{run}", "--resume", "model.stem_layers="], ["stem_layers", "empty"]),
    (["train", "--out", "{run}", "--resume", "--steps", "0"], ["--steps", "positive integer"]),
    (["train", "--out", "{run}", "--resume", "--steps", "1.5"], ["--steps", "1.5"]),
    # YAML that is not a config
    (["train", "--out", "{run}", "--resume", "--config", "{tmp}/garbage.yaml"], ["garbage.yaml", "not valid YAML", "line"]),
    (["train", "--out", "{run}", "--resume", "--config", "{tmp}/list.yaml"], ["list.yaml", "mapping"]),
    (["train", "--out", "{run}", "--resume", "--config", "{tmp}/missing.yaml"], ["missing.yaml", "does not exist"]),
    (["eval-ppl", "--ckpt", "{tmp}/garbage_ckpt"], ["config.yaml", "not valid YAML"]),
    # devices, in every command that takes one
    (["train", "--out", "{run}", "--resume", "run.device=bogus"], ["run.device", "'bogus'", "unknown"]),
    (["train", "--out", "{run}", "--resume", "run.device=cuda:99"], ["run.device", "cuda:99"]),
    (["eval-ppl", "--ckpt", "{run}", "--device", "bogus"], ["--device", "'bogus'"]),
    (["eval-ppl", "--ckpt", "{run}", "--device", "cuda:99"], ["--device", "cuda:99"]),
    (["generate", "--ckpt", "{run}", "--prompt", "x", "--device", "bogus"], ["--device", "'bogus'"]),
    (["generate", "--ckpt", "{run}", "--prompt", "x", "--device", "cuda:99"], ["--device", "cuda:99"]),
    *([] if GPU else [(["eval-ppl", "--ckpt", "{run}", "--device", "cuda"], ["--device", "not available"]),
                      (["generate", "--ckpt", "{run}", "--prompt", "x", "--device", "cuda"], ["--device", "not available"]),
                      (["train", "--out", "{run}", "--resume", "run.device=cuda"], ["run.device", "not available"])]),
    # option ranges
    (["eval-ppl", "--ckpt", "{run}", "--batch-size", "0"], ["--batch-size", "positive integer"]),
    (["eval-ppl", "--ckpt", "{run}", "--batches", "-1"], ["--batches", "positive integer"]),
    (["eval-ppl", "--ckpt", "{run}", "--batches", "100000"], ["batches 100000", "holds only"]),
    (["eval-ppl", "--ckpt", "{run}", "--seq-len", "4096"], ["seq_len 4096", "max_seq_len 128"]),
    (["generate", "--ckpt", "{run}", "--prompt", "x", "--cache-rows", "-1"], ["--cache-rows", "-1"]),
    (["generate", "--ckpt", "{run}", "--prompt", "x", "--max-new-tokens", "0"], ["--max-new-tokens"]),
    (["generate", "--ckpt", "{run}", "--prompt", "x", "--top-p", "0"], ["--top-p", "(0, 1]"]),
    (["generate", "--ckpt", "{run}", "--prompt", "x", "--temperature", "nan"], ["--temperature"]),
    (["generate", "--ckpt", "{run}", "--prompt", "x", "--cache-window", "1"], ["--cache-window", "[0, 1)"]),
    (["generate", "--ckpt", "{run}", "--prompt", LONG_PROMPT], ["prompt of", "max_seq_len=128"]),
    (["edit", "--ckpt", "{run}", "--swap", "Spain=Germany", "--prompt", "x", "--top-k", "0"], ["--top-k"]),
    (["edit-eval", "--ckpt", "{run}", "--data", "{data}", "--pairs", "0"], ["--pairs", "positive integer"]),
    (["analyze", "geometry", "--ckpt", "{run}", "--data", "{data}", "--out", "{tmp}/an", "--seq-len", "4096"],
     ["--seq-len 4096", "max_seq_len 128"]),
    (["info", "--seq-len", "0"], ["--seq-len"]),
    (["info", "model.d_model=abc"], ["d_model", "'abc'", "integer"]),
    (["plan", "--batch", "0"], ["--batch"]),
    (["data", "prepare", "--vocab-size", "0", "--out", "{tmp}/d"], ["--vocab-size"]),
    (["demo", "--steps", "0", "--out", "{tmp}/demo"], ["--steps"]),
    (["convert", "--to-hf", "--ckpt", "{run}", "--out", "{tmp}/hf", "--seed", "-1"], ["--seed"]),
    (["nosuchcommand"], ["unknown command"]),
]


def _fill(argv, files):
    return [a.format(**{k: str(v) for k, v in files.items()}) for a in argv]


@pytest.mark.parametrize("argv, words", CASES, ids=[" ".join(a[:1] + a[-2:])[:60] for a, _ in CASES])
def test_bad_input_is_one_line_and_changes_nothing(files, capsys, argv, words):
    before = _snapshot(files["run"])
    code = main(_fill(argv, files))
    out, err = capsys.readouterr()
    assert code == 2, err
    assert err.count("\n") == 1 and err.endswith("\n") and "Traceback" not in err, err
    assert err.startswith("stemlm"), err
    for word in words:
        assert word in err, (word, err)
    assert out == ""  # nothing was started (generate echoes no prompt)
    assert _snapshot(files["run"]) == before


@pytest.mark.parametrize("argv, words", [
    (["edit", "--ckpt", "{tmp}/trunc_ckpt", "--swap", "Spain=Germany", "--prompt", "The capital of Spain is",
      "--tables", "disk"], ["model.safetensors"]),
    (["generate", "--ckpt", "{run}", "--prompt", "x", "--tables", "disk", "--tables-file", "{tmp}/tables.safetensors"],
     ["tables.safetensors", "truncated"]),
])
def test_truncated_table_file_is_an_error_not_a_crash(files, argv, words):
    """In a process of its own: a mapped file shorter than its tensor would kill it with SIGBUS."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run([sys.executable, "-m", "stemlm", *_fill(argv, files)], capture_output=True, text=True,
                          env=env, timeout=120)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and proc.stdout == "", proc.stderr
    for word in words:
        assert word in proc.stderr
