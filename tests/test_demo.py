"""The facts demo: trains on the facts corpus, measures recall, reports a row swap, leaves the checkpoint alone."""

import hashlib

import pytest

from stemlm.cli import main
from stemlm.demo import SPLIT_LABELS, format_demo, run_demo


def _digest(run_dir):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted((run_dir / "checkpoints").rglob("*.safetensors"))}


def test_short_demo_reports_recall_and_a_swap_without_touching_the_checkpoint(tmp_path):
    demo = run_demo(str(tmp_path / "demo"), steps=12, progress=False)
    assert set(demo.recall) == set(SPLIT_LABELS)
    assert all(0 <= known <= asked and asked > 0 for known, asked in demo.recall.values())
    assert len(demo.reports) == 2 and all(len(r.panels) == 3 for r in demo.reports)
    assert all(p.exists() and p.stat().st_size > 0 for p in demo.plots)
    original, target, edited = demo.reports[0].panels
    assert "Spain" in original.prompt and "Germany" in target.prompt and edited.prompt == original.prompt
    text = format_demo(demo)
    assert "held-out phrasings" in text and "stemlm edit --ckpt" in text
    before = _digest(demo.run_dir)
    again = run_demo(str(tmp_path / "demo"), steps=12, progress=False)  # a finished run is reused
    assert again.checkpoint == demo.checkpoint and _digest(demo.run_dir) == before
    assert again.recall == demo.recall


def test_demo_cli_refuses_bad_options(capsys):
    assert main(["demo", "--steps", "0"]) == 2
    assert "argument --steps: '0' is not a positive integer" in capsys.readouterr().err
    assert main(["demo", "--swap", "Spain"]) == 2
    assert "--swap expects A=B" in capsys.readouterr().err


@pytest.mark.slow
def test_full_demo_knows_capitals_and_the_swap_moves_the_answer(tmp_path):
    demo = run_demo(str(tmp_path / "demo"), progress=False)
    known, asked = demo.recall["train"]
    assert known / asked >= 0.8
    original, target, edited = demo.reports[0].panels
    assert original.tokens[0] == " Madrid" and target.tokens[0] == " Berlin" and edited.tokens[0] == " Berlin"
