"""The benchmark scripts' ``--quick`` smoke modes run end to end and write well-formed results.

Timings of a smoke run mean nothing; these tests check that each script still runs and that its
JSON has the fields the README table is read from. Results go to a temporary directory.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from stemlm.version import git_commit

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def launch(script: str, tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """Run ``benchmarks/<script> --quick ARGS`` with results under ``tmp_path``."""
    env = {**os.environ, "STEMLM_BENCH_RESULTS": str(tmp_path)}
    return subprocess.run([sys.executable, str(BENCH / script), "--quick", *args], env=env, cwd=BENCH,
                          capture_output=True, text=True, timeout=600)


def run_quick(script: str, tmp_path: Path, *args: str) -> str:
    """``launch`` that must succeed; returns its stdout."""
    proc = launch(script, tmp_path, *args)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def test_train_step_quick_splits_the_gap(tmp_path):
    out = run_quick("bench_train_step.py", tmp_path, "model.d_model=32")
    r = json.loads((tmp_path / "train_step_d_model32.quick.json").read_text())
    assert r["meta"]["quick"] is True
    assert r["overrides"] == ["model.d_model=32"] and r["stem_layers"] == 3
    times = r["seconds_per_step"]
    assert set(times) == {"dense", "stem", "up_projection", "stem_own"} and min(times.values()) > 0
    assert r["flop_ratio"] == pytest.approx(r["train_flops_per_token"]["stem"] / r["train_flops_per_token"]["dense"])
    assert r["gap"] == pytest.approx(r["time_ratio"] / r["flop_ratio"] - 1)
    assert r["flop_ratio_causal"] < r["flop_ratio"] < 1
    assert "STEM's own work" in out
    assert (tmp_path / "train_step_widths.quick.png").stat().st_size > 0


def test_matmul_ab_quick_alternates_separate_processes(tmp_path):
    out = run_quick("bench_matmul_ab.py", tmp_path, "--shapes", "p3-stem")
    r = json.loads((tmp_path / "matmul_ab.quick.json").read_text())["shapes"]["p3-stem"]
    assert set(r["runs"]) == {"onednn", "aten"} and r["runs"]["aten"][0]["arm"] == "aten"
    assert r["aten_over_onednn"] == [r["runs"]["aten"][0]["median_s"] / r["runs"]["onednn"][0]["median_s"]]
    assert "aten ÷ onednn" in out
    auto = r["auto"]  # run.matmul=auto's fresh probe in a process of its own, and whether it picked the A/B's winner
    assert auto["picked"] in ("aten", "onednn") and auto["aten_s"] > 0 and auto["onednn_s"] > 0
    winner = "aten" if r["aten_faster_in_every_pair"] else "onednn" if r["onednn_faster_in_every_pair"] else None
    assert r["auto_picks_the_winner"] == (None if winner is None else auto["picked"] == winner)


def test_train_step_width_plot_keeps_to_one_sweep(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    import bench_train_step as bench

    def result(overrides, batch=16, quick=False):
        return {"meta": {"quick": quick}, "preset": "tiny", "overrides": overrides, "batch_size": batch, "seq_len": 256}
    base = result([])
    assert bench.backbone_width(base) == 256 and bench.backbone_width(result(["model.d_model=768"])) == 768
    assert bench.same_sweep(base, result(["model.d_model=768", "model.d_ff=2048"]))
    assert not bench.same_sweep(base, result(["model.n_layers=2"]))  # another shape change: not a width sweep
    assert not bench.same_sweep(base, result([], batch=8)) and not bench.same_sweep(base, result([], quick=True))


def test_bad_shape_override_is_a_clear_error(tmp_path):
    proc = launch("bench_train_step.py", tmp_path, "d_model=32")
    assert proc.returncode == 2 and "overrides must look like model.FIELD=VALUE" in proc.stderr
    assert not list(tmp_path.iterdir())


def test_weight_grad_quick_times_every_arm_in_rounds(tmp_path):
    out = run_quick("bench_weight_grad.py", tmp_path)
    r = json.loads((tmp_path / "weight_grad.quick.json").read_text())["shapes"]
    for shape in ("p7-dense", "p3-stem"):
        s = r[shape]["step_seconds"]
        assert len(s["aten"]) == len(s["onednn-grad-first"]) == len(s["onednn"]) == 2
        for other in ("aten", "onednn-grad-first"):
            assert r[shape][f"{other}_over_onednn"]["rounds"] == [a / o for a, o in zip(s[other], s["onednn"])]
    assert "onednn-grad-first" in out and "p3-stem" in out


def test_vs_hf_quick_reports_paired_ratio(tmp_path):
    run_quick("bench_vs_hf.py", tmp_path)
    r = json.loads((tmp_path / "vs_hf.quick.json").read_text())
    steps = r["step_seconds"]
    other = {"aten": "onednn", "onednn": "aten"}[r["matmul"]]  # the GEMMs run.matmul=auto picked, the other beside
    assert all(len(steps[k]) == r["steps"] == 2 for k in ("stemlm", "hf", f"stemlm_{other}", "stemlm_compiled"))
    assert f"ratio_{other}" in r
    ratios = sorted(h / s for h, s in zip(steps["hf"], steps["stemlm"]))
    assert r["ratio"] == pytest.approx(sum(ratios) / 2)  # median of two rounds
    assert r["goal_met"] == (r["ratio"] >= 1.3)


@pytest.mark.parametrize("script, result", [("bench_mfu.py", "mfu.quick.json"),
                                            ("bench_sparse_optim.py", "sparse_optim.quick.json")])
def test_other_training_benchmarks_quick(tmp_path, script, result):
    run_quick(script, tmp_path)
    r = json.loads((tmp_path / result).read_text())
    assert r["meta"]["quick"] is True
    assert r["meta"]["git_commit"] == git_commit(BENCH)  # the commit of the code that produced it


@pytest.mark.slow
@pytest.mark.parametrize("script, result", [("bench_offload_decode.py", "offload_decode.quick.json"),
                                            ("bench_stem_vs_dense_decode.py", "stem_vs_dense_decode.quick.json"),
                                            ("bench_cache_hit.py", "cache_hit.quick.json"),
                                            ("bench_serve.py", "bench_serve.quick.json"),
                                            ("bench_packed_prefill.py", "packed_prefill.quick.json")])
def test_store_benchmarks_quick(tmp_path, script, result):
    run_quick(script, tmp_path)
    assert json.loads((tmp_path / result).read_text())["meta"]["quick"] is True


@pytest.mark.slow
def test_kill_resume_robustness_quick(tmp_path):
    out = run_quick("robustness_kill_resume.py", tmp_path)
    r = json.loads((tmp_path / "robustness_kill_resume.quick.json").read_text())
    assert r["passed"] is True and r["meta"]["git_commit"]
    assert sorted(e["phase"] for e in r["events"]) == ["save", "save", "train", "train"]
    assert all(e["inside_save"] for e in r["events"] if e["phase"] == "save")
    assert r["final"]["losses_equal"] and r["final"]["weights_equal"] and r["final"]["optimizer_equal"]
    assert r["corrupt_case"]["refused_by_load_model"] and r["corrupt_case"]["warned"]
    assert "PASSED" in out


@pytest.mark.slow
def test_eval_vs_harness_quick_scores_alike(tmp_path):
    """Loads the pinned SmolLM2 GGUF (~36 s): the same requests through the engine and lm-eval's hf backend."""
    pytest.importorskip("lm_eval")
    out = run_quick("bench_eval_vs_harness.py", tmp_path)
    r = json.loads((tmp_path / "eval_vs_harness.quick.json").read_text())
    assert r["n_requests"] == 16 and r["meta"]["git_commit"] and r["meta"]["quick"] is True
    assert r["max_abs_logprob_diff"] <= 1e-4 and r["accuracies_identical"] is True
    assert min(r["seconds"]["stemlm"]) > 0 and "speed ratio" in out


def test_core_sharing_quick_times_every_setting_against_alone(tmp_path):
    out = run_quick("bench_core_sharing.py", tmp_path)
    r = json.loads((tmp_path / "core_sharing.quick.json").read_text())
    assert set(r["step_ms"]) == {"alone", "thread", "process", "idle_process"}
    assert all(len(v) == 1 and v[0] > 0 for v in r["step_ms"].values())
    assert r["slowdown"]["process"] == r["step_ms"]["process"][0] / r["step_ms"]["alone"][0] - 1
    assert "share of one core" in out


def test_every_benchmark_script_is_listed_in_the_benchmarks_readme():
    listed = (BENCH / "README.md").read_text()
    scripts = [p.name for p in [*BENCH.glob("*.py"), *BENCH.glob("*.sh")] if not p.name.startswith("_")]
    assert scripts and [s for s in scripts if f"`{s}`" not in listed] == []
