"""What a first-time user meets: the end-of-run report, re-running a finished run, loading a run
directory with transformers, `--version`, defaults in every `--help`, and links in the docs."""

import argparse
import hashlib
import importlib
import re
from pathlib import Path

import pytest
import torch
from train_helpers import one_thread  # noqa: F401

import stemlm
from stemlm.store import open_model
from stemlm.cli import COMMANDS, ArgumentParser, main
from stemlm.data import prepare_facts_corpus

QUIET = ["run.peak_flops=1e11", "run.progress=false"]
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A finished 6-step debug run on the facts corpus (with plots, so the report lists them)."""
    out = tmp_path_factory.mktemp("first") / "run"
    torch.set_num_threads(1)
    args = ["train", "--preset", "debug", "--data", str(prepare_facts_corpus(progress=False)), "--out", str(out),
            "--steps", "6", *QUIET]
    return out, args


def _files(run_dir: Path) -> dict:
    return {str(p.relative_to(run_dir)): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
            for p in sorted(run_dir.rglob("*")) if p.is_file() and p.name != "train.lock"}  # the lock is taken anew


def test_the_run_says_what_it_made_and_a_rerun_changes_nothing(run, capsys):
    out, args = run
    assert main(args) == 0
    text = capsys.readouterr().out
    ckpt = out / "checkpoints" / "step_00000006"
    assert f"checkpoint  {ckpt}" in text
    assert f"{out / 'loss_vs_tokens.png'}, {out / 'loss_vs_flops.png'}" in text
    for command in (f'stemlm generate --ckpt {out} --prompt "The capital of France is"', f"stemlm eval-ppl --ckpt {out}",
                    f"stemlm edit --ckpt {out} --swap Spain=Germany", f"stemlm train --config {out / 'config.yaml'} --resume"):
        assert command in text, command
    before = _files(out)
    assert main([*args, "--resume"]) == 0
    again = capsys.readouterr().out
    assert f"{out} is already finished (6 steps): nothing was trained or changed" in again
    assert _files(out) == before  # summary.json included: same bytes, not even rewritten
    assert again.split("unigram")[1] == text.split("unigram")[1]  # the same report, from summary.json


def test_a_run_directory_loads_with_transformers(run, capsys):
    out, args = run
    if not (out / "checkpoints").exists():
        assert main(args) == 0
    pytest.importorskip("transformers")
    import stemlm.interop.hf  # noqa: F401  (registers the Auto classes)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    ref = open_model(out)
    ids = torch.randint(0, ref.cfg.vocab_size, (2, 12))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids))
    assert type(model).__name__ == "StemForCausalLM"


def test_eval_ppl_says_how_many_batches_it_read(run, capsys):
    out, args = run
    if not (out / "checkpoints").exists():
        assert main(args) == 0
    capsys.readouterr()
    assert main(["eval-ppl", "--ckpt", str(out), "--batches", "3", "--no-progress"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("val loss"))
    assert re.search(r"\(3 of \d+ batches of 4 x 32\)", line), line


def test_version_names_the_release(capsys):
    assert main(["--version"]) == 0
    text = capsys.readouterr().out.strip()
    assert text.startswith(f"stemlm {stemlm.__version__}")
    if (REPO / ".git").exists():
        assert re.search(r"\(git [0-9a-f]{12}(-dirty)?\)$", text), text


def _parsers():
    for name, (module_name, _) in COMMANDS.items():
        parser = ArgumentParser(prog=f"stemlm {name}")
        importlib.import_module(module_name).add_arguments(parser)
        yield name, parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                yield from ((f"{name} {sub}", p) for sub, p in action.choices.items())


def test_every_option_shows_its_default():
    missing = []
    for name, parser in _parsers():
        formatter = parser._get_formatter()
        for action in parser._actions:
            if not action.option_strings or action.nargs == 0 or action.required or action.help is None:
                continue
            if id(action) in formatter.no_default:  # one of a required either-or group
                continue
            if "default" not in formatter._get_help_string(action).lower():
                missing.append(f"{name} {action.option_strings[-1]}")
        parser.format_help()  # every help text renders (no stray % in help strings)
    assert not missing, missing


def test_help_through_the_entry_point_shows_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # unwrap
    assert "hot-row LFU cache size per table (host/disk tiers) (default: 0)" in text
    assert "sample among the k most likely tokens (default: none)" in text


def test_docs_link_only_files_of_the_repository():
    bad = []
    for page in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if target.startswith(("http://", "https://", "#")):
                continue
            path = target.split("#")[0]
            resolved = (page.parent / path).resolve()
            if path.startswith(("/", "~", "file:")) or REPO not in resolved.parents or not resolved.exists():
                bad.append(f"{page.name}: {target}")
        bad += [f"{page.name}: {m}" for m in re.findall(r"`(/(?:work|home|root|tmp)/[^`]*)`", page.read_text())]
    assert not bad, bad
