"""`stemlm study`: a debug-sized study end to end, resume, the eval stage's contract, the report from JSON."""

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
import yaml
from train_helpers import make_token_data, one_thread  # noqa: F401

from stemlm import accounting as acc
from stemlm.cli import main
from stemlm.data import TokenDataset
from stemlm.presets import model_config
from stemlm.config import ConfigError
from stemlm.study import Study, load_spec, loss_roi, plan
from stemlm.study.spec import STUDIES_DIR
from stemlm.study.report import write_report
from stemlm.study.tables import compare_rows, load_results
from stemlm.study.variants import matched_dense_width, parameter_match
from stemlm.train import Trainer
from stemlm.train.evaluate import evaluate, loss_by_position

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return make_token_data(tmp_path_factory.mktemp("data"))


def write_spec(path: Path, data_dir: Path, **changes) -> Path:
    spec = {"name": "ci", "data_dir": str(data_dir),
            "train": ["run.peak_flops=1e11", "run.eval_every=4", "run.eval_batches=2", "run.ckpt_every=4"],
            "sizes": {"d64": {"preset": "debug"}},
            "budget": {"steps": 8, "batch_size": 4, "seq_len": 32},
            "compare": {"sizes": ["d64"], "seeds": [0], "variants": ["dense", "stem-1/3"], "lr": 3e-2},
            "stability": {"size": "d64", "variants": ["stem-1/3"], "lrs": ["1e-3", 1.0e6], "steps": 4},
            "context": {"size": "d64", "variants": ["stem-1/3"], "seq_len": 64, "steps": 2, "position_batches": 2},
            "timing": {"rounds": 2, "warmup": 1, "steps": 2},
            "eval": {"tasks": ["country_facts", "arc_easy"], "niah_tasks": ["needle"], "limit": 5,
                     "command": [sys.executable, str(FIXTURES / "fake_eval.py")]}}
    spec.update(changes)
    path.write_text(yaml.safe_dump(spec))
    return path


def _run(spec: Path, tmp: Path, *extra: str) -> int:
    return main(["study", "run", "--spec", str(spec), "--results", str(tmp / "res"), "--scratch", str(tmp / "scratch"),
                 *extra])


def test_study_end_to_end_resumes_and_reports_from_json(data_dir, tmp_path, capsys):
    spec = write_spec(tmp_path / "ci.yaml", data_dir)
    assert _run(spec, tmp_path) == 0
    out = capsys.readouterr()
    assert "5 runs trained (1 diverged), 0 skipped" in out.out and "stage midtrain: not in study spec" in out.err
    res = tmp_path / "res"
    runs = {p.stem: json.loads(p.read_text()) for p in (res / "runs").glob("*.json")}
    assert set(runs) == {"compare-d64-dense-seed0", "compare-d64-stem-1_3-seed0", "stability-d64-stem-1_3-lr0.001",
                         "stability-d64-stem-1_3-lr1e+06", "context-d64-stem-1_3-L64"}
    stem = runs["compare-d64-stem-1_3-seed0"]
    assert stem["status"] == "finished" and stem["metrics"]["steps"] == 8 and stem["git_commit"]
    assert stem["seeds"] == {"run.seed": 0, "data.seed": 0}
    assert stem["accounting"]["train_flops_per_token"] < runs["compare-d64-dense-seed0"]["accounting"]["train_flops_per_token"]
    assert [v["step"] for v in stem["metrics"]["val"]] == [4, 8]  # val loss vs FLOPs and wall time from metrics.jsonl
    assert stem["metrics"]["val"][1]["flops"] == pytest.approx(stem["metrics"]["flops_seen"])
    assert stem["geometry"]["layers"] and stem["capacity"]["unique_tokens_at_seq_len"] > 1
    diverged = runs["stability-d64-stem-1_3-lr1e+06"]
    assert diverged["status"] == "diverged" and " is nan at step " in diverged["diverged_message"]
    assert diverged["metrics"]["steps"] < 4 and diverged["metrics"]["final_val_loss"] is None
    ctx = runs["context-d64-stem-1_3-L64"]
    assert ctx["init_from"] == stem["checkpoint"] and ctx["config"]["data"]["doc_masking"] is True
    assert len(ctx["position_loss"]["final"]) == 64 and len(ctx["position_loss"]["init"]) == 64
    evals = sorted(p.name for p in (res / "eval").glob("*.json"))
    assert evals == ["compare-d64-dense-seed0.final.json", "compare-d64-stem-1_3-seed0.final.json",
                     "context-d64-stem-1_3-L64.final.json"]
    assert set(json.loads((res / "eval" / evals[2]).read_text())["result"]["tasks"]) == {"needle"}
    timing = json.loads((res / "timing.json").read_text())  # step times measured side by side
    steps = timing["sizes"]["d64"]
    assert set(steps) == {"dense", "stem-1/3"} and all(v["step_seconds"] > 0 and len(v["rounds"]) == 2 for v in steps.values())
    assert steps["dense"]["vs_dense"] == 1.0 and timing["git_commit"]
    assert not (tmp_path / "scratch" / "timing").exists()  # its throw-away runs are gone
    report = (res / "report.md").read_text()
    for text in ("Matched-budget comparison", "| stem-1/3 |", "Stability", "| diverged |", "Context extension",
                 "arc_easy", "Definitions", "step s (× dense)", "measured side by side", "## The paper's claims"):
        assert text in report, text
    for png in ("loss_vs_flops_and_wall_d64.png", "spikes_vs_lr.png", "loss_by_position.png", "niah.png", "roi.png"):
        assert (res / png).stat().st_size > 1000, png

    mtimes = {p: p.stat().st_mtime_ns for p in [*(res / "runs").glob("*.json"), res / "timing.json"]}
    assert _run(spec, tmp_path) == 0  # everything finished: nothing retrains, re-evaluates or re-times
    assert "0 runs trained (0 diverged), 5 skipped" in capsys.readouterr().out
    assert {p: p.stat().st_mtime_ns for p in [*(res / "runs").glob("*.json"), res / "timing.json"]} == mtimes

    shutil.rmtree(tmp_path / "scratch")  # the report needs the JSON only
    for p in [res / "report.md", *res.glob("*.png")]:
        p.unlink()
    assert main(["study", "report", str(res), "--out", str(tmp_path / "rep")]) == 0
    assert (tmp_path / "rep" / "report.md").read_text() == report
    assert (tmp_path / "rep" / "roi.png").exists()


def test_changed_spec_reruns_only_changed_runs_and_a_stopped_run_resumes(data_dir, tmp_path, capsys):
    spec = write_spec(tmp_path / "ci.yaml", data_dir, stability=None, context=None, eval=None)
    study = Study(load_spec(spec), tmp_path / "res", tmp_path / "scratch", log=lambda m: None)
    dense = study.by_name["compare-d64-dense-seed0"]
    cfg = study.train_config(dense, None, str(data_dir))
    Trainer(cfg, resume=True).fit(stop_at=4)  # a study killed after step 4 of this run
    assert _run(spec, tmp_path, "--skip-eval") == 0
    assert "eval stage skipped (--skip-eval)" in capsys.readouterr().err
    records = [json.loads(line) for line in (study.run_dir(dense) / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 9))  # continued at step 5, not restarted
    ref_cfg = study.train_config(dense, None, str(data_dir))
    ref_cfg.run.out = str(tmp_path / "ref")
    ref = Trainer(ref_cfg).fit()  # the same run, never stopped
    assert json.loads((tmp_path / "res" / "runs" / f"{dense.name}.json").read_text())["metrics"]["final_val_loss"] == \
        pytest.approx(ref.val_loss, abs=1e-6)
    write_spec(spec, data_dir, stability=None, context=None, eval=None,
               compare={"sizes": ["d64"], "seeds": [0], "variants": ["dense", "stem-1/3"], "lr": 2e-3})
    stale = json.loads((tmp_path / "res" / "runs" / f"{dense.name}.json").read_text())["spec_hash"]
    assert _run(spec, tmp_path, "--skip-eval", "--stages", "compare") == 0
    assert "2 runs trained" in capsys.readouterr().out
    assert json.loads((tmp_path / "res" / "runs" / f"{dense.name}.json").read_text())["spec_hash"] != stale


def test_eval_unavailable_is_one_line_and_the_study_goes_on(data_dir, tmp_path, capsys, monkeypatch):
    import stemlm.cli

    monkeypatch.delitem(stemlm.cli.COMMANDS, "eval", raising=False)
    spec = write_spec(tmp_path / "ci.yaml", data_dir, stability=None, context=None,
                      budget={"steps": 2, "batch_size": 2, "seq_len": 16}, eval={"tasks": ["arc_easy"]},
                      compare={"sizes": ["d64"], "seeds": [0], "variants": ["dense"], "geometry": False})
    assert _run(spec, tmp_path) == 0
    lines = [line for line in capsys.readouterr().err.splitlines() if "eval" in line]
    assert lines == ["stemlm study: eval stage skipped: `stemlm eval` is not available in this stemlm (no eval command); "
                     "the report shows no eval scores (use --skip-eval to silence this)"]


def test_report_reads_hand_written_eval_fixture(data_dir, tmp_path):
    """The eval contract's JSON (a fixture) feeds the accuracy columns and the paper's ROI."""
    spec = write_spec(tmp_path / "ci.yaml", data_dir, stability=None, context=None, eval=None,
                      budget={"steps": 2, "batch_size": 2, "seq_len": 16})
    study = Study(load_spec(spec), tmp_path / "res", tmp_path / "scratch", log=lambda m: None)
    study.run(("compare",))
    fixture = json.loads((FIXTURES / "study_eval.json").read_text())
    for run, acc_ in (("compare-d64-dense-seed0", 0.5), ("compare-d64-stem-1_3-seed0", 0.6)):
        fixture["tasks"]["arc_easy"]["acc"] = acc_
        (tmp_path / "res" / "eval").mkdir(exist_ok=True)
        (tmp_path / "res" / "eval" / f"{run}.final.json").write_text(json.dumps(
            {"run": run, "point": "final", "tasks": ["arc_easy"], "limit": 5, "result": fixture}))
    rows = {r["variant"]: r for r in compare_rows(*load_results(tmp_path / "res"))["d64"]}
    f_stem, f_dense = rows["stem-1/3"]["train_flops_per_token"], rows["dense"]["train_flops_per_token"]
    mean_stem, mean_dense = (0.25 + 0.6 + 0.5) / 3, (0.25 + 0.5 + 0.5) / 3
    assert rows["stem-1/3"]["paper_roi"] == pytest.approx((mean_stem / f_stem) / (mean_dense / f_dense))
    assert rows["dense"]["paper_roi"] == pytest.approx(1.0)
    stem_arc = rows["stem-1/3"]["acc_detail"]["arc_easy"]
    assert (stem_arc["acc"], stem_arc["stderr"], stem_arc["chance"], stem_arc["above"]) == (0.6, 0.049, 0.25, True)
    assert rows["stem-1/3"]["acc_detail"]["needle"]["above"] is None  # no chance level in the fixture: not judged
    report = write_report(tmp_path / "res").read_text()
    assert "**0.600 ± 0.049**" in report and "| chance |" in report


def test_loss_roi_formula():
    # H = 6, dense gains 1 nat at F=100; STEM gains 1.2 at F=90 -> (1.2/90)/(1/100)
    assert loss_roi(4.8, 90.0, 5.0, 100.0, 6.0) == pytest.approx((1.2 / 90) / (1.0 / 100))
    assert loss_roi(5.0, 100.0, 5.0, 100.0, 6.0) == pytest.approx(1.0)
    assert loss_roi(4.0, 100.0, 6.5, 100.0, 6.0) is None  # a baseline below the unigram model: undefined


def test_parameter_matching_by_accounting():
    tiny = model_config("tiny", ffn="dense")
    moe = parameter_match(tiny, "hash_moe-1/3")
    assert moe["n_experts"] == 6 and moe["total_params"] == moe["reference_total_params"]  # (2·256+4096)/768 = 6 exactly
    wide = matched_dense_width(tiny)
    step = 3 * tiny.d_model * tiny.n_layers  # parameters per unit of d_ff
    assert abs(wide["total_params"] - wide["reference_total_params"]) <= step / 2
    assert wide["total_params"] == acc.total_params(tiny.replace(d_ff=wide["d_ff"]))


def test_loss_by_position_averages_to_the_eval_loss(data_dir):
    torch.manual_seed(0)
    from stemlm.model.decoder import StemLM
    model = StemLM(model_config("debug", ffn="stem"))
    ds = TokenDataset.open(data_dir, "val")
    by_pos = loss_by_position(model, ds, 2, 32, 3)
    assert len(by_pos) == 32
    assert sum(by_pos) / 32 == pytest.approx(evaluate(model, ds, 2, 32, 3)["loss"], rel=1e-5)


def test_bad_specs_are_one_line_errors(data_dir, tmp_path, capsys):
    bad = {"variants": write_spec(tmp_path / "a.yaml", data_dir, compare={"sizes": ["d64"], "seeds": [0], "variants": ["stem"]}),
           "unknown keys": write_spec(tmp_path / "b.yaml", data_dir, colour="red"),
           "compare does not train": write_spec(tmp_path / "c.yaml", data_dir,
                                                context={"size": "d64", "variants": ["dense"], "seed": 3, "seq_len": 64}),
           "no seeds for size": write_spec(tmp_path / "d.yaml", data_dir,
                                           compare={"sizes": ["d64"], "seeds": {"d32": [0]}, "variants": ["dense"]})}
    for needle, spec in bad.items():
        assert main(["study", "plan", "--spec", str(spec)]) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and ("placement" if needle == "variants" else needle) in err
    assert main(["study", "report", str(tmp_path / "nothing")]) == 2
    assert "no study results" in capsys.readouterr().err


def test_repo_specs_plan():
    """The committed specs expand: quick and full both hold every stage; full has 2 sizes, 2 seeds at the smaller."""
    full, quick = plan(load_spec("full")), plan(load_spec("quick"))
    assert {r.stage for r in full} == {"compare", "stability", "context", "midtrain"}
    compare = [r for r in full if r.stage == "compare"]
    assert len({r.labels["size"] for r in compare}) >= 2 and len({r.labels["seed"] for r in compare}) >= 2
    assert {r.labels["seed"] for r in compare if r.labels["size"] == "d128"} == {0, 1}
    assert {"dense", "stem-1/3", "stem-1/2", "stem-full", "stem_dagger-1/3", "stem_gate-1/3", "hash_moe-1/3",
            "dense-wide"} <= {r.labels["variant"] for r in compare}
    assert {r.stage for r in quick} >= {"compare", "stability", "context"}
    assert len({r.spec_hash for r in full}) == len(full)


def test_midtrain_stage_converts_a_llama_and_continues_both(data_dir, tmp_path, capsys):
    """The mid-training stage on a small random Llama: converted dense and STEM (project tables), same
    tokens and lr; eval at step 0 (the converted model) and at the end."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                                         intermediate_size=128, vocab_size=512, max_position_embeddings=128))
    llama.save_pretrained(tmp_path / "llama")
    spec = write_spec(tmp_path / "ci.yaml", data_dir, compare=None, stability=None, context=None,
                      midtrain={"source": str(tmp_path / "llama"), "stem_layers": "1/3", "steps": 3, "lr": 1e-3,
                                "data_dir": str(data_dir), "train": ["run.eval_every=3"]})
    assert _run(spec, tmp_path) == 0
    assert "2 runs trained (0 diverged)" in capsys.readouterr().out
    res = tmp_path / "res"
    dense, stem = (json.loads((res / "runs" / f"midtrain-llama-{v}.json").read_text()) for v in ("dense", "stem-1_3"))
    assert dense["accounting"]["layer_kinds"] == ["dense"] * 3 and stem["accounting"]["layer_kinds"] == ["dense", "dense", "stem"]
    assert dense["config"]["optim"]["lr"] == stem["config"]["optim"]["lr"] == 1e-3
    assert dense["config"]["run"]["stage"] == "midtrain" and stem["metrics"]["steps"] == 3
    # step 0 is the converted model: both start from the same random Llama, near its loss
    assert dense["metrics"]["val_loss_init"] == pytest.approx(stem["metrics"]["val_loss_init"], abs=0.05)
    assert {p.name for p in (res / "eval").glob("midtrain-*")} == {
        f"midtrain-llama-{v}.{p}.json" for v in ("dense", "stem-1_3") for p in ("init", "final")}
    report = (res / "report.md").read_text()
    assert "Mid-training insertion" in report and "arc_easy 0 → end" in report and (res / "midtrain_loss.png").exists()


def test_context_run_of_a_diverged_run_is_not_run(data_dir, tmp_path, capsys):
    spec = write_spec(tmp_path / "ci.yaml", data_dir, stability=None, eval=None,
                      compare={"sizes": ["d64"], "seeds": [0], "variants": ["dense"], "lr": 1.0e6, "geometry": False},
                      context={"size": "d64", "variants": ["dense"], "seq_len": 64, "steps": 2})
    assert _run(spec, tmp_path) == 0
    captured = capsys.readouterr()
    assert "1 runs trained (1 diverged)" in captured.out
    assert "context-d64-dense-L64: not trained, the run it continues (compare-d64-dense-seed0) diverged" in captured.err
    assert not (tmp_path / "res" / "runs" / "context-d64-dense-L64.json").exists()


def test_spec_with_unknown_eval_task_is_refused(tmp_path):
    """A task name `stemlm eval` does not know is a one-line ConfigError at load, not a failed eval hours later."""
    spec = yaml.safe_load((STUDIES_DIR / "quick.yaml").read_text())
    spec["eval"]["niah_tasks"] = ["niah"]
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(spec))
    with pytest.raises(ConfigError, match=r"unknown eval.niah_tasks \['niah'\]"):
        load_spec(path)


def test_claim_verdicts_follow_their_rules():
    from stemlm.study.claims import _all_or_some, _knowledge, _stability

    def row(variant, lr, spikes, status="finished"):
        return {"variant": variant, "lr": lr, "spikes": spikes, "status": status}

    calm = [row("stem-1/3", 0.1, 0), row("hash_moe-1/3", 0.1, 3), row("stem-1/3", 0.3, 1), row("hash_moe-1/3", 0.3, 0, "diverged")]
    assert _stability(calm)["verdict"] == "holds"
    assert _stability([row("stem-1/3", 0.1, 2), row("hash_moe-1/3", 0.1, 2)])["verdict"] == "does not hold"
    assert "1 of 2 lrs diverged" in _stability(calm)["measured"]
    assert _stability([row("stem-1/3", 0.1, 0), row("hash_moe-1/3", 0.1, 0)])["verdict"] == "not measurable"

    def variant(name, acc, se=0.02, above=True):
        return {"variant": name, "acc_detail": {"country_facts": {"acc": acc, "stderr": se, "above": above}}}

    rising = {"d": [variant("dense", 0.2), variant("stem-1/3", 0.3), variant("stem-1/2", 0.35), variant("stem-full", 0.4)]}
    assert _knowledge(rising)["verdict"] == "holds"
    falling = {"d": [variant("dense", 0.4), variant("stem-1/3", 0.3), variant("stem-full", 0.2)]}
    assert _knowledge(falling)["verdict"] == "does not hold"
    chance = {"d": [variant(n, 0.1, above=False) for n in ("dense", "stem-1/3")]}
    assert _knowledge(chance)["verdict"] == "not measurable"
    assert (_all_or_some([True, True]), _all_or_some([True, False]), _all_or_some([False])) == \
        ("holds", "mixed", "does not hold")


def test_single_seed_size_borrows_the_measured_seed_noise():
    """A size trained with one seed has no half-range of its own: the largest measured one stands in."""
    from stemlm.study.claims import _ablation

    def row(variant, loss, spread, n):
        return {"variant": variant, "val_loss": loss, "val_loss_spread": spread, "n": n}

    two_seeds = [row("stem-1/3", 4.70, 0.03, 2), row("stem_gate-1/3", 4.80, 0.02, 2)]
    assert _ablation({"d128": two_seeds})["verdict"] == "holds"
    close = [row("stem-1/3", 4.50, 0.0, 1), row("stem_gate-1/3", 4.55, 0.0, 1)]  # 0.05 apart < 2 x 0.03
    assert _ablation({"d128": two_seeds, "d256": close})["verdict"] == "mixed"
    far = [row("stem-1/3", 4.50, 0.0, 1), row("stem_gate-1/3", 4.60, 0.0, 1)]
    assert _ablation({"d128": two_seeds, "d256": far})["verdict"] == "holds"


def test_checkpoints_are_found_in_the_scratch_dir_given_now(data_dir, tmp_path):
    """A result written from another working directory records a path relative to it: the run's
    checkpoint is looked up in the scratch dir of this study first, then at the recorded path."""
    study = Study(load_spec(write_spec(tmp_path / "s.yaml", data_dir)), tmp_path / "res", tmp_path / "scratch",
                  log=lambda m: None)
    run = study.by_name["compare-d64-stem-1_3-seed0"]
    recorded = {"checkpoint": "elsewhere/runs/x/checkpoints/step_00000008"}
    assert study.checkpoint(run, recorded) == recorded["checkpoint"]
    here = study.run_dir(run) / "checkpoints" / "step_00000008"
    here.mkdir(parents=True)
    assert study.checkpoint(run, recorded) == str(here)
    assert study.checkpoint(run, {"checkpoint": None}) is None
