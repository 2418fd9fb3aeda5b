"""``benchmarks/check.py``: independent runs, interleaved, summarized against the committed figures."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import check  # noqa: E402

FAKE = """
import json, os, pathlib, sys
out = pathlib.Path(os.environ["STEMLM_BENCH_RESULTS"])
runs = pathlib.Path(sys.argv[1])
n = len(list(runs.glob("*"))) if runs.exists() else 0
runs.mkdir(exist_ok=True)
(runs / str(n)).write_text("")
(out / "fake.json").write_text(json.dumps({"ratio": [1.2, 1.4, 1.35][n % 3]}))
"""


def test_runs_are_interleaved_summarized_and_judged(tmp_path):
    script = tmp_path / "bench_fake.py"
    script.write_text(FAKE)
    committed = tmp_path / "results"
    committed.mkdir()
    (committed / "fake.json").write_text(json.dumps({"ratio": 1.36}))
    fake = check.Check("fake", "P9", str(script), "fake.json", lambda r: {"ratio": r["ratio"]},
                       {"ratio": ("≥ 1.3×", lambda v: v >= 1.3)}, args=[str(tmp_path / "count")])
    log = []
    report = check.run_checks([fake], 3, tmp_path / "scratch", results=committed, log=log.append)
    e = report["checks"]["fake"]["figures"]["ratio"]
    assert e["runs"] == [1.2, 1.4, 1.35] and (e["min"], e["max"], e["median"]) == (1.2, 1.4, 1.35)
    assert e["reproduced"] is True  # 1.36 lies in [1.2, 1.4]
    assert e["met_every_run"] is False and e["met_some_run"] and e["committed_met"] and e["flip"]
    assert len(log) == 3 and not report["checks"]["fake"]["errors"]
    md = check.markdown(report)
    at = report["commit"]
    assert f"| P9 fake | {at} | ratio | 1.36 | 1.35 [1.2, 1.4] (3) | yes | ≥ 1.3× | **no** | **yes** |" in md
    # a later --only selection keeps this check, with the commit it was measured at
    older = {**report, "commit": "abc1234", "checks": {"fake": {**report["checks"]["fake"], "commit": "abc1234"}}}
    other = {**report, "checks": {"other": {**report["checks"]["fake"], "label": "P8"}}}
    both = check.merged(other, older)
    assert set(both["checks"]) == {"fake", "other"} and both["checks"]["fake"]["commit"] == "abc1234"
    assert "| P9 fake | abc1234 |" in check.markdown(both) and check.merged(other, None) is other


def test_a_failing_run_is_reported_and_unknown_names_refused(tmp_path):
    script = tmp_path / "bench_broken.py"
    script.write_text("raise SystemExit('no data here')")
    broken = check.Check("broken", "P0", str(script), "broken.json", lambda r: r, {})
    report = check.run_checks([broken], 1, tmp_path / "scratch", results=tmp_path, log=lambda *_: None)
    assert report["checks"]["broken"]["errors"] == ["exit 1: no data here"]
    assert [c.name for c in check.select("P7,serve")] == ["vs_hf", "serve"]
    with pytest.raises(SystemExit, match="unknown check"):
        check.select("P99")


def test_slow_checks_run_only_when_asked_and_read_their_committed_results():
    default, everything = check.select(None), check.select(None, everything=True)
    slow = [c.name for c in everything if c not in default]
    assert slow == ["cache_hit", "wide_corpus", "eval_vs_harness", "soak", "edit", "quant", "insertion", "distill_speed",
                    "edit_real"]
    assert not any(c.slow for c in default)
    assert [c.name for c in check.select("P5,soak")] == ["cache_hit", "soak"]  # --only reaches them
    for c in everything:  # every figure extractor reads the committed JSON it re-measures
        figures = check.committed_figures(c)
        assert figures and set(c.goals) <= set(figures), c.name


def test_each_run_gets_a_fresh_work_dir(tmp_path, monkeypatch):
    """``run_once`` points ``STEMLM_BENCH_WORK`` at a new folder per run, and the benchmarks that train or convert
    keep their models under it (``bench_work``), so a re-run never reads the last run's models."""
    from _train_bench import bench_work

    seen = []
    monkeypatch.setattr(check.subprocess, "run", lambda cmd, env, **kw: seen.append(env["STEMLM_BENCH_WORK"]) or
                        type("P", (), {"returncode": 1, "stderr": "x", "stdout": ""})())
    c = check.select("edit")[0]
    for _ in range(2):
        assert "error" in check.run_once(c, tmp_path)
    assert len(set(seen)) == 2 and all(str(tmp_path) in w for w in seen)
    monkeypatch.setenv("STEMLM_BENCH_WORK", str(tmp_path / "w"))
    assert bench_work(Path("runs") / "edit") == tmp_path / "w" / "edit"
    monkeypatch.delenv("STEMLM_BENCH_WORK")
    assert bench_work(Path("runs") / "edit") == Path("runs") / "edit"


def test_the_real_edit_check_replays_the_committed_runs_sample():
    """A re-run with other pair / prompt counts measures other edits: the check passes the committed ones."""
    committed = json.loads((Path(check.RESULTS) / "edit_real.json").read_text())
    args = check.EDIT_REAL_ARGS
    assert args[args.index("--pairs") + 1] == str(committed["pairs"])
    assert args[args.index("--locality") + 1] == str(committed["locality"])
    extra = {a.split("=")[0]: [int(x) for x in a.split("=")[1].split(",")]
             for a, prev in zip(args[1:], args) if prev == "--placement"}
    placements = committed["placements"]["heldout_template"]
    assert all(placements[label]["layers"] == layers for label, layers in extra.items())
