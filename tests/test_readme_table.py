"""README.md's results table is generated from benchmarks/results/*.json by benchmarks/readme_table.py:
it must be current, a stale one is caught, and rows follow their JSON (goal verdicts included)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"


def table_cli(*args: str) -> subprocess.CompletedProcess:
    """``python benchmarks/readme_table.py ARGS``."""
    return subprocess.run([sys.executable, str(BENCH / "readme_table.py"), *args], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})


@pytest.fixture
def readme_table(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    import readme_table
    return readme_table


def test_readme_results_table_is_current():
    proc = table_cli("--check")
    assert proc.returncode == 0, proc.stderr + "\nrun: python benchmarks/readme_table.py"


def test_check_catches_a_stale_table_and_a_rewrite_fixes_it(tmp_path):
    readme = tmp_path / "README.md"
    current = (ROOT / "README.md").read_text()
    readme.write_text(current.replace("| P3 MFU", "| P3 MFU (edited by hand)", 1))
    proc = table_cli("--check", "--readme", str(readme))
    assert proc.returncode == 1 and "out of date" in proc.stderr
    assert table_cli("--readme", str(readme)).returncode == 0
    assert readme.read_text() == current
    assert table_cli("--check", "--readme", str(readme)).returncode == 0


def test_readme_without_markers_is_a_clear_error(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("# no table here\n")
    proc = table_cli("--check", "--readme", str(readme))
    assert proc.returncode == 2 and "lacks the marker lines" in proc.stderr


def test_rows_without_results_are_left_out_and_verdicts_follow_the_json(tmp_path, readme_table):
    results = tmp_path / "benchmarks" / "results"
    results.mkdir(parents=True)
    mfu = json.loads((BENCH / "results" / "mfu.json").read_text())
    for kind in ("dense", "stem"):  # above the goal here, whatever the committed run measured
        mfu["runs"][kind]["mfu"] = readme_table.MFU_GOAL + 0.01
    (results / "mfu.json").write_text(json.dumps(mfu))
    table, notes = readme_table.render(tmp_path)
    rows = table.splitlines()[2:]
    assert len(rows) == 1 and rows[0].startswith("| P3 MFU") and rows[0].endswith("| yes |")
    from _results_table import ROWS

    assert len(notes) == len(ROWS) - 1 and not any("mfu.json" in n for n in notes)
    mfu["runs"]["stem"]["mfu"] = readme_table.MFU_GOAL - 0.01  # below the goal: the verdict changes with the JSON
    mfu["meta"] = {"git_commit": "0123456789ab-dirty"}
    (results / "mfu.json").write_text(json.dumps(mfu))
    row = readme_table.render(tmp_path)[0].splitlines()[2]
    assert row.endswith("| no |") and f"STEM {100 * (readme_table.MFU_GOAL - 0.01):.1f} %" in row
    assert "at `0123456-dirty`" in row


def test_batch_decode_row_reads_the_benchmark_json(tmp_path, readme_table):
    """The row for bench_batch_decode.py, from a real (smoke) run of it."""
    env = {**os.environ, "STEMLM_BENCH_RESULTS": str(tmp_path), "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(BENCH / "bench_batch_decode.py"), "--quick"], cwd=BENCH, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = tmp_path / "benchmarks" / "results"
    results.mkdir(parents=True)
    shutil.copy(tmp_path / "batch_decode.quick.json", results / "batch_decode.json")
    r = json.loads((results / "batch_decode.json").read_text())
    row = next(line for line in readme_table.render(tmp_path)[0].splitlines() if "bench_batch_decode.py" in line)
    for tier, res in r["tiers"].items():
        ratio = res["summary"]["speed_ratio_b8_over_b1"]
        assert f"{tier}: **{ratio:.2f}×**" in row
        assert f"{tier}: {'yes' if ratio >= readme_table.BATCH_GOAL else 'no'}" in row.rsplit("|", 2)[1]


def test_the_insertion_grid_row_reads_the_current_default_from_calibration_config(monkeypatch):
    """The README's grid row names the entry measured with today's CalibrationConfig defaults, and the best
    distilled one; the goals follow their deltas."""
    monkeypatch.syspath_prepend(str(BENCH))
    from _insertion_grid_report import default_entry, readme_cell

    from stemlm.insert.calibrate import CalibrationConfig

    d = CalibrationConfig()
    default = {"method": d.method, "unseen": d.unseen, "sequential": d.sequential, "refit_down": d.refit_down,
               "shrink": d.shrink, "als_rounds": d.als_rounds, "layer_choice": d.layer_choice, "tokens": 1024}

    def entry(cal, ood):
        return {"calibration": cal, "delta_ood_mean": ood, "delta": {"in_domain": ood / 2}}

    runs = {"dense": {"in_domain": 3.0, "technical": 2.0, "legal": 2.5},
            "a": entry(default, 0.8), "b": entry({**default, "method": "mean"}, 0.1),
            "c": entry({**default, "distill_steps": 10}, 0.4), "e": entry({**default, "distill_steps": 20}, 0.6)}
    assert default_entry({k: v for k, v in runs.items() if k != "dense"}) is runs["a"]
    measured, verdict = readme_cell({"runs": runs})
    assert "+0.80" in measured and "+0.40" in measured
    assert verdict == "step 0, default flags: yes; after local distillation: yes"
    runs["c"]["delta_ood_mean"] = 0.7
    assert readme_cell({"runs": runs})[1] == "step 0, default flags: yes; after local distillation: no"
    runs["f"] = entry({**default, "tokens": d.tokens}, 0.9)  # the default token count too: that entry is the default
    assert default_entry({k: v for k, v in runs.items() if k != "dense"}) is runs["f"]
