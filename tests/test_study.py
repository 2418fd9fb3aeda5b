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
    spec = {"name": "ci", "data_dir": str(data_dir), "optim": "paper",
            "train": ["run.peak_flops=1e11", "run.eval_every=2", "run.eval_batches=2", "run.ckpt_every=4"],
            "sizes": {"d64": {"preset": "debug"}},
            "budget": {"steps": 8, "batch_size": 4, "seq_len": 32},
            "sweep": {"size": "d64", "seeds": [0], "steps": 4, "lrs": ["3e-3", 3.0e-2], "variants": ["dense", "stem-1/3"]},
            "stability": {"variants": ["stem-1/3"], "lrs": [1.0e6]},
            "compare": {"sizes": ["d64"], "seeds": [0, 1], "variants": ["dense", "stem-1/3"]},
            "context": {"size": "d64", "seeds": [0], "variants": ["stem-1/3"], "seq_len": 64, "steps": 2,
                        "position_batches": 2},
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
    assert "10 runs trained (1 diverged), 0 skipped" in out.out and "stage midtrain: not in study spec" in out.err
    res = tmp_path / "res"
    runs = {p.stem: json.loads(p.read_text()) for p in (res / "runs").glob("*.json")}
    sweep = {f"sweep-d64-{v}-lr{lr}-seed0" for v in ("dense", "stem-1_3") for lr in ("0.003", "0.03")}
    assert set(runs) == sweep | {"sweep-d64-stem-1_3-lr1e+06-seed0", "context-d64-stem-1_3-L64-seed0"} | {
        f"compare-d64-{v}-seed{s}" for v in ("dense", "stem-1_3") for s in (0, 1)}
    stress = runs["sweep-d64-stem-1_3-lr1e+06-seed0"]
    assert stress["status"] == "diverged" and " is nan at step " in stress["diverged_message"]
    assert stress["labels"]["roles"] == ["stress"] and runs["sweep-d64-dense-lr0.03-seed0"]["labels"]["roles"] == ["tune"]
    tuned = json.loads((res / "study.json").read_text())["tuned"]
    for v in ("dense", "stem-1/3"):  # the best sweep lr of each variant is the one its comparison runs use
        name = f"sweep-d64-{v.replace('/', '_')}-lr{{}}-seed0"
        best = min((3e-3, 3e-2), key=lambda lr: runs[name.format(f"{lr:g}")]["metrics"]["final_val_loss"])
        assert tuned[v]["lr"] == best and runs[f"compare-d64-{v.replace('/', '_')}-seed1"]["config"]["optim"]["lr"] == best
    stem = runs["compare-d64-stem-1_3-seed1"]
    assert stem["status"] == "finished" and stem["metrics"]["steps"] == 8 and stem["git_commit"]
    assert stem["seeds"] == {"run.seed": 1, "data.seed": 1}  # a seed fixes init and data order
    o = stem["config"]["optim"]  # Table 2: one lr and one weight decay for every parameter, tables included
    assert (o["table_lr"], o["table_weight_decay"], o["table_optimizer"], o["warmup_ratio"]) == (o["lr"], 0.1, "dense", 0.01)
    assert stem["accounting"]["train_flops_per_token"] < runs["compare-d64-dense-seed0"]["accounting"]["train_flops_per_token"]
    assert [v["step"] for v in stem["metrics"]["val"]] == [2, 4, 6, 8]  # val loss vs FLOPs and wall time from metrics.jsonl
    assert [p[0] for p in stem["metrics"]["train"]] == list(range(1, 9))  # every step logged
    assert stem["metrics"]["val"][-1]["flops"] == pytest.approx(stem["metrics"]["flops_seen"])
    assert stem["geometry"]["layers"] and stem["capacity"]["unique_tokens_at_seq_len"] > 1
    assert len(stem["val_batches"]) == 2 and "skipped" in stem["probes"]["knowledge"]  # no tokenizer in this data
    ctx = runs["context-d64-stem-1_3-L64-seed0"]
    assert ctx["init_from"] == runs["compare-d64-stem-1_3-seed0"]["checkpoint"] and ctx["config"]["data"]["doc_masking"] is True
    assert len(ctx["position_loss"]["final"]) == 64 and len(ctx["position_loss"]["init"]) == 64
    evals = sorted(p.name for p in (res / "eval").glob("*.json"))
    assert evals == sorted([f"compare-d64-{v}-seed{s}.final.json" for v in ("dense", "stem-1_3") for s in (0, 1)]
                           + ["context-d64-stem-1_3-L64-seed0.final.json"])
    assert set(json.loads((res / "eval" / "context-d64-stem-1_3-L64-seed0.final.json").read_text())["result"]["tasks"]) == {"needle"}
    timing = json.loads((res / "timing.json").read_text())  # step times measured side by side
    steps = timing["sizes"]["d64"]
    assert set(steps) == {"dense", "stem-1/3"} and all(v["step_seconds"] > 0 and len(v["rounds"]) == 2 for v in steps.values())
    assert steps["dense"]["vs_dense"] == 1.0 and timing["git_commit"]
    assert not (tmp_path / "scratch" / "timing").exists()  # its throw-away runs are gone
    report = (res / "report.md").read_text()
    for text in ("Equal tuning", "Matched-budget comparison", "| stem-1/3 |", "Stability", "| diverged (",
                 "Context extension", "arc_easy", "Definitions", "step s (× dense)", "measured side by side",
                 "## The paper's claims", "gap to dense", "Table 3", "inconclusive"):
        assert text in report, text
    for png in ("loss_vs_flops_and_wall_d64.png", "spikes_vs_lr.png", "stability_curves.png", "loss_by_position.png",
                "niah.png", "roi.png", "gap_vs_tokens.png"):
        assert (res / png).stat().st_size > 1000, png

    mtimes = {p: p.stat().st_mtime_ns for p in [*(res / "runs").glob("*.json"), res / "timing.json"]}
    assert _run(spec, tmp_path) == 0  # everything finished: nothing retrains, re-evaluates or re-times
    assert "0 runs trained (0 diverged), 10 skipped" in capsys.readouterr().out
    assert {p: p.stat().st_mtime_ns for p in [*(res / "runs").glob("*.json"), res / "timing.json"]} == mtimes

    shutil.rmtree(tmp_path / "scratch")  # the report needs the JSON only
    for p in [res / "report.md", *res.glob("*.png")]:
        p.unlink()
    assert main(["study", "report", str(res), "--out", str(tmp_path / "rep")]) == 0
    assert (tmp_path / "rep" / "report.md").read_text() == report
    assert (tmp_path / "rep" / "roi.png").exists()


def test_compare_waits_for_the_sweep_and_plan_shows_it(data_dir, tmp_path, capsys):
    spec = write_spec(tmp_path / "ci.yaml", data_dir, stability=None, context=None, eval=None)
    assert main(["study", "plan", "--spec", str(spec), "--results", str(tmp_path / "res")]) == 0
    out = capsys.readouterr().out
    assert "compare-d64-dense-seed0" in out and "pending: waits for the sweep to pick its lr" in out
    study = Study(load_spec(spec), tmp_path / "res", tmp_path / "scratch", log=lambda m: None)
    study.ensure(study.by_name["sweep-d64-dense-lr0.003-seed0"], {"trained": 0, "diverged": 0})
    study.replan()  # half of dense's grid is done: no lr is picked from a partial sweep
    assert study.tuned == {} and study.by_name["compare-d64-dense-seed0"].pending
    assert _run(spec, tmp_path, "--skip-eval", "--stages", "compare") == 0  # the sweep is trained first
    captured = capsys.readouterr()
    assert "training the sweep first" in captured.err and "7 runs trained" in captured.out
    assert main(["study", "plan", "--spec", str(spec), "--results", str(tmp_path / "res")]) == 0
    assert "pending" not in (out := capsys.readouterr().out) and "tuned lrs: dense" in out


def test_changed_spec_reruns_only_changed_runs_and_a_stopped_run_resumes(data_dir, tmp_path, capsys):
    spec = write_spec(tmp_path / "ci.yaml", data_dir, sweep=None, stability=None, context=None, eval=None,
                      compare={"sizes": ["d64"], "seeds": [0], "variants": ["dense", "stem-1/3"], "lr": 3e-2})
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
    write_spec(spec, data_dir, sweep=None, stability=None, context=None, eval=None,
               compare={"sizes": ["d64"], "seeds": [0], "variants": ["dense", "stem-1/3"], "lr": 2e-3})
    stale = json.loads((tmp_path / "res" / "runs" / f"{dense.name}.json").read_text())["spec_hash"]
    assert _run(spec, tmp_path, "--skip-eval", "--stages", "compare") == 0
    assert "2 runs trained" in capsys.readouterr().out
    assert json.loads((tmp_path / "res" / "runs" / f"{dense.name}.json").read_text())["spec_hash"] != stale


def test_eval_unavailable_is_one_line_and_the_study_goes_on(data_dir, tmp_path, capsys):
    spec = write_spec(tmp_path / "ci.yaml", data_dir, sweep=None, stability=None, context=None,
                      budget={"steps": 2, "batch_size": 2, "seq_len": 16},
                      eval={"tasks": ["arc_easy"], "command": [str(tmp_path / "no-such-stemlm"), "eval"]},
                      compare={"sizes": ["d64"], "seeds": [0], "variants": ["dense"], "geometry": False, "lr": 3e-3})
    assert _run(spec, tmp_path) == 0
    lines = [line for line in capsys.readouterr().err.splitlines() if "eval" in line]
    assert lines == [f"stemlm study: eval stage skipped: eval command {str(tmp_path / 'no-such-stemlm')!r} not found; "
                     "the report shows no eval scores (use --skip-eval to silence this)"]


def test_report_reads_hand_written_eval_fixture(data_dir, tmp_path):
    """The eval contract's JSON (a fixture) feeds the accuracy columns and the paper's ROI."""
    spec = write_spec(tmp_path / "ci.yaml", data_dir, sweep=None, stability=None, context=None, eval=None,
                      budget={"steps": 2, "batch_size": 2, "seq_len": 16},
                      compare={"sizes": ["d64"], "seeds": [0], "variants": ["dense", "stem-1/3"], "lr": 3e-2})
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
    cmp = {"sizes": ["d64"], "seeds": [0], "variants": ["dense"], "lr": 3e-3}
    bad = {"variants": write_spec(tmp_path / "a.yaml", data_dir, compare={**cmp, "variants": ["stem"]}),
           "unknown keys": write_spec(tmp_path / "b.yaml", data_dir, colour="red"),
           "compare does not train": write_spec(tmp_path / "c.yaml", data_dir, compare=cmp,
                                                context={"size": "d64", "variants": ["dense"], "seed": 3, "seq_len": 64}),
           "no seeds for size": write_spec(tmp_path / "d.yaml", data_dir, compare={**cmp, "seeds": {"d32": [0]}}),
           "unknown option": write_spec(tmp_path / "e.yaml", data_dir, compare={**cmp, "variants": ["stem-1/3+fast"]}),
           "not in the sweep": write_spec(tmp_path / "f.yaml", data_dir, compare={**cmp, "lr": "tuned",
                                                                                  "variants": ["stem-1/2"]}),
           "optim must be": write_spec(tmp_path / "g.yaml", data_dir, optim="fast"),
           "sweep.lrs must be": write_spec(tmp_path / "h.yaml", data_dir, sweep={"size": "d64", "lrs": ["fast"],
                                                                                 "variants": ["dense"]}),
           "sweep needs lrs": write_spec(tmp_path / "i.yaml", data_dir, sweep={"size": "d64", "variants": ["dense"]})}
    for needle, spec in bad.items():
        assert main(["study", "plan", "--spec", str(spec)]) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and ("placement" if needle == "variants" else needle) in err
    assert main(["study", "report", str(tmp_path / "nothing")]) == 2
    assert "no study results" in capsys.readouterr().err


def test_repo_specs_plan():
    """The committed specs expand: every variant in the sweep (>= 3 lrs) and in the comparison (>= 3 seeds),
    stemlm's table setting as its own variant (full, quick), the paper's optimizer setting; the GPU spec is the
    second scale of (a) and (a′): dense and the three placements on the wide corpus."""
    for name in ("full", "quick", "gpu"):
        spec = load_spec(name)
        runs = plan(spec)
        stages = {r.stage for r in runs}
        assert {"sweep", "compare"} <= stages and spec["optim"] == "paper", name
        compare = [r for r in runs if r.stage == "compare"]
        assert all(r.pending for r in compare)  # they wait for the sweep's lrs
        assert len({r.labels["seed"] for r in compare}) >= 3 and len(spec["sweep"]["lrs"]) >= 3, name
        assert set(spec["compare"]["variants"]) <= set(spec["sweep"]["variants"]), name
        assert name == "gpu" or "stem-1/3+tablex10" in spec["compare"]["variants"], name
        tuned = plan(spec, {v: 1e-3 for v in spec["sweep"]["variants"]})
        assert len({r.spec_hash for r in tuned}) == len(tuned) and not any(r.pending for r in tuned), name
    full = plan(load_spec("full"))
    assert {"context", "controls"} <= {r.stage for r in full}
    assert {"dense", "stem-1/3", "stem-1/2", "stem-full", "stem_dagger-1/3", "stem_gate-1/3", "hash_moe-1/3"} <= \
        {r.labels["variant"] for r in full if r.stage == "compare"}
    gpu = load_spec("gpu")
    assert gpu["data_dir"] == "wide" and gpu["sizes"]["d384"]["model"]["d_model"] == 384
    assert gpu["compare"]["variants"] == ["dense", "stem-1/3", "stem-1/2", "stem-full"]


def test_midtrain_stage_converts_a_llama_and_continues_both(data_dir, tmp_path, capsys):
    """The mid-training stage on a small random Llama: converted dense and STEM (project tables), same
    tokens and lr; eval at step 0 (the converted model) and at the end."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                                         intermediate_size=128, vocab_size=512, max_position_embeddings=128))
    llama.save_pretrained(tmp_path / "llama")
    spec = write_spec(tmp_path / "ci.yaml", data_dir, sweep=None, compare=None, stability=None, context=None,
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
    spec = write_spec(tmp_path / "ci.yaml", data_dir, sweep=None, stability=None, eval=None,
                      compare={"sizes": ["d64"], "seeds": [0], "variants": ["dense"], "lr": 1.0e6, "geometry": False},
                      context={"size": "d64", "variants": ["dense"], "seq_len": 64, "steps": 2})
    assert _run(spec, tmp_path) == 0
    captured = capsys.readouterr()
    assert "1 runs trained (1 diverged)" in captured.out
    assert "context-d64-dense-L64-seed0: not trained, the run it continues (compare-d64-dense-seed0) diverged" in captured.err
    assert not (tmp_path / "res" / "runs" / "context-d64-dense-L64-seed0.json").exists()


def test_spec_with_unknown_eval_task_is_refused(tmp_path):
    """A task name `stemlm eval` does not know is a one-line ConfigError at load, not a failed eval hours later."""
    spec = yaml.safe_load((STUDIES_DIR / "quick.yaml").read_text())
    spec["eval"]["niah_tasks"] = ["niah"]
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(spec))
    with pytest.raises(ConfigError, match=r"unknown eval.niah_tasks \['niah'\]"):
        load_spec(path)


def test_midtrain_claim_reads_arms_by_their_labels():
    """(e): every STEM arm against the dense arm, by labels; one seed is inconclusive, its validation batches are
    not replicates (no pseudo-replication)."""
    from stemlm.study.claims import claim_rows

    def arm(variant, ffn, init, anneal, seed, loss, batches):
        return {"name": f"midtrain-{variant}-{seed}", "stage": "midtrain", "status": "finished",
                "labels": {"variant": variant, "ffn": ffn, "init": init, "anneal": anneal, "seed": seed, "source": "s"},
                "metrics": {"final_val_loss": loss, "val_loss_init": 3.0}, "val_batches": batches}

    one_seed = [arm("dense", "dense", "zero", "off", 0, 3.00, [3.0, 3.1, 2.9, 3.0]),
                arm("calibrated", "stem", "calibrate", "off", 0, 2.90, [2.9, 3.0, 2.8, 2.9]),
                arm("blend", "stem_dagger", "calibrate", "blend", 0, 3.30, [3.3, 3.4, 3.2, 3.3])]
    row = next(r for r in claim_rows(one_seed, {}) if r["key"] == "midtrain")
    verdicts = {p["label"].split(" ")[0]: p["verdict"] for p in row["parts"]}
    assert verdicts == {"calibrated": "inconclusive", "blend": "inconclusive"} and row["verdict"] == "inconclusive"
    assert "no noise estimate" in row["measured"] and "validation batch" not in row["measured"]
    assert "anneal blend" in row["measured"]
    seeds = [arm("dense", "dense", "zero", "off", s, 3.0 + 0.1 * s, []) for s in range(3)]
    seeds += [arm("cal", "stem", "calibrate", "off", s, 3.0 + 0.1 * s + d, []) for s, d in enumerate((-0.1, 0.1, 0.0))]
    row = next(r for r in claim_rows(seeds, {}) if r["key"] == "midtrain")
    assert row["verdict"] == "inconclusive" and "(n=3 paired)" in row["measured"]


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


def test_midtrain_specs_plan_every_arm_on_the_same_tokens():
    """The CPU and GPU mid-training specs plan dense, calibrated, project and gradual arms with one
    budget each (same steps, batch, sequence length and lr in every arm)."""
    for name in ("midtrain", "midtrain-gpu"):
        runs = [r for r in plan(load_spec(name)) if r.stage == "midtrain"]
        assert {"dense", "stem-calibrated", "stem-project", "stem-gradual"} <= {r.labels["variant"] for r in runs}, name
        budgets = {tuple(o for o in r.overrides if o.split("=")[0] in
                         ("run.steps", "data.batch_size", "data.seq_len", "optim.lr")) for r in runs}
        assert len(budgets) == 1, (name, budgets)


def test_a_midtrain_arm_s_own_overrides_come_after_the_shared_ones():
    """An arm's ``train`` list (a STEM-only knob such as the table lr) reaches only that arm, last;
    anything but a list of key=value strings is a one-line error."""
    from stemlm.study.midtrain import midtrain_arms, midtrain_runs

    m = {"source": "smollm2", "steps": 2, "batch_size": 1, "seq_len": 8, "train": ["run.eval_every=1"],
         "arms": {"dense": {"ffn": "dense"}, "stem": {"ffn": "stem", "init": "zero"},
                  "stem-lr": {"ffn": "stem", "init": "zero", "train": ["optim.table_lr=3e-4"]}}}
    runs = {r.labels["variant"]: r for r in midtrain_runs({"budget": {}}, m)}
    assert runs["stem-lr"].overrides[-1] == "optim.table_lr=3e-4"
    assert runs["stem-lr"].overrides[:-1] == runs["stem"].overrides
    assert not any(o.startswith("optim.table_lr") for o in runs["stem"].overrides)
    with pytest.raises(ConfigError, match="train must be a list of key=value overrides"):
        midtrain_arms({"arms": {"a": {"ffn": "stem", "train": "optim.table_lr=1"}}})


def test_a_distilled_midtrain_arm_has_the_dense_conversion_as_its_teacher():
    from stemlm.study.midtrain import midtrain_arms, midtrain_runs

    m = {"source": "smollm2", "steps": 2, "batch_size": 1, "seq_len": 8,
         "arms": {"dense": {"ffn": "dense"}, "kd": {"ffn": "stem", "init": "zero", "distill": {"weight": 0.3, "top_k": 8}}}}
    runs = {r.labels["variant"]: r for r in midtrain_runs({"budget": {}}, m)}
    assert runs["kd"].teacher == runs["dense"].convert and runs["dense"].teacher is None
    assert {"run.distill_weight=0.3", "run.distill_top_k=8"} <= set(runs["kd"].overrides)
    assert "teacher" in runs["kd"].hash_input(None) and "teacher" not in runs["dense"].hash_input(None)
    with pytest.raises(ConfigError, match="distill must be a mapping"):
        midtrain_arms({"arms": {"a": {"ffn": "stem", "distill": {"alpha": 1}}}})


def test_a_midtrain_arm_s_calibration_settings_go_over_the_stage_s():
    from stemlm.study.midtrain import midtrain_arms, midtrain_runs

    m = {"source": "smollm2", "steps": 2, "batch_size": 1, "seq_len": 8, "calibration": {"tokens": 512, "shrink": 0.0},
         "arms": {"dense": {"ffn": "dense"}, "a": {"ffn": "stem", "init": "calibrate"},
                  "b": {"ffn": "stem", "init": "calibrate", "calibration": {"shrink": 1024, "layer_choice": "cheapest"}}}}
    runs = {r.labels["variant"]: r for r in midtrain_runs({"budget": {}}, m)}
    assert runs["a"].convert["calibration"] == {"tokens": 512, "shrink": 0.0}
    assert runs["b"].convert["calibration"] == {"tokens": 512, "shrink": 1024, "layer_choice": "cheapest"}
    assert runs["a"].hash_input(None) != runs["b"].hash_input(None)
    with pytest.raises(ConfigError, match="calibration must be a mapping"):
        midtrain_arms({"arms": {"a": {"ffn": "stem", "calibration": "cheapest"}}})


def test_a_midtrain_arm_s_calibration_text_goes_over_the_stage_s():
    from stemlm.study.midtrain import midtrain_runs

    m = {"source": "smollm2", "steps": 2, "batch_size": 1, "seq_len": 8, "calib_data": "wide",
         "arms": {"dense": {"ffn": "dense"}, "a": {"ffn": "stem", "init": "calibrate"},
                  "b": {"ffn": "stem", "init": "calibrate", "calib_data": "/data/mine"}}}
    runs = {r.labels["variant"]: r for r in midtrain_runs({"budget": {}}, m)}
    assert runs["a"].convert["calib_data"] == "wide"
    assert runs["b"].convert["calib_data"] == "/data/mine"
    assert runs["a"].hash_input(None) != runs["b"].hash_input(None)


def test_plan_of_a_midtrain_spec_lists_its_arms(tmp_path, capsys):
    """A spec without model sizes (a pretrained model's mid-training) plans and estimates without error."""
    assert main(["study", "plan", "--spec", "midtrain", "--results", str(tmp_path / "res")]) == 0
    out = capsys.readouterr().out
    assert "midtrain-smollm2-dense" in out and "midtrain-smollm2-stem-calibrated" in out


def test_a_stored_evaluation_covering_more_tasks_is_not_redone(data_dir, tmp_path):
    """An eval JSON with the run's hash and limit that covers the tasks asked counts (a mid-training run
    evaluated by its own spec on more tasks, reused by a study that asks for fewer); one that lacks a task is redone."""
    from stemlm.study.evalstage import run_evals

    spec = write_spec(tmp_path / "ci.yaml", data_dir, sweep=None, stability=None, context=None,
                      budget={"steps": 2, "batch_size": 2, "seq_len": 16},
                      eval={"tasks": ["arc_easy"], "limit": 5, "command": [sys.executable, str(FIXTURES / "fake_eval.py")]},
                      compare={"sizes": ["d64"], "seeds": [0], "variants": ["dense"], "geometry": False, "lr": 3e-3})
    study = Study(load_spec(spec), tmp_path / "res", tmp_path / "scratch", log=lambda m: None)
    study.run(("compare",))
    run = study.runs[0]
    stored = {"run": run.name, "run_spec_hash": run.spec_hash, "limit": 5, "point": "final",
              "tasks": ["arc_easy", "piqa"], "result": {"tasks": {"arc_easy": {"acc": 0.5}, "piqa": {"acc": 0.5}}}}
    path = tmp_path / "res" / "eval" / f"{run.name}.final.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(stored))
    assert run_evals(study) == {"done": 0, "skipped": 1, "failed": 0, "unavailable": 0}
    path.write_text(json.dumps({**stored, "tasks": ["piqa"]}))
    assert run_evals(study)["done"] == 1
    assert json.loads(path.read_text())["tasks"] == ["arc_easy"]


def test_runner_refuses_a_dirty_checkout_unless_told(tmp_path, monkeypatch, data_dir):
    """A run's recorded commit must reproduce it: changed tracked files or untracked code refuse to train."""
    import subprocess

    from stemlm.study import runner

    repo = tmp_path / "repo"
    (repo / "stemlm").mkdir(parents=True)
    git = lambda *a: subprocess.run(["git", "-C", str(repo), *a], check=True, capture_output=True)  # noqa: E731
    git("init", "-q")
    (repo / "stemlm" / "a.py").write_text("x = 1\n")
    git("add", "-A")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "a")
    runner.check_clean(repo)  # clean: nothing raised
    (repo / "results.json").write_text("{}")  # untracked results are not code
    (repo / "results" / "runs").mkdir(parents=True)
    (repo / "results" / "runs" / "a.json").write_text("{}")
    git("add", "-A")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "r")
    (repo / "results" / "runs" / "a.json").write_text('{"rerun": 1}')  # a study rewriting its own result
    runner.check_clean(repo)
    (repo / "stemlm" / "b.py").write_text("y = 2\n")
    with pytest.raises(runner.DirtyTree, match=r"untracked files \(stemlm/b.py\).*--allow-dirty"):
        runner.check_clean(repo)
    (repo / "stemlm" / "b.py").unlink()
    (repo / "stemlm" / "a.py").write_text("x = 3\n")
    with pytest.raises(runner.DirtyTree, match="changes to tracked files"):
        runner.check_clean(repo)
    monkeypatch.setattr(runner, "REPO", repo)
    monkeypatch.delenv("STEMLM_ALLOW_DIRTY")
    study = Study(load_spec(write_spec(tmp_path / "s.yaml", data_dir)), tmp_path / "res", tmp_path / "scratch",
                  log=lambda m: None)
    with pytest.raises(runner.DirtyTree):
        study.run(("compare",))
    assert not list((tmp_path / "res").glob("runs/*.json"))


def test_gpu_spec_and_its_quick_form_are_one_study(tmp_path, data_dir):
    """`--spec gpu --quick` is gpu.yaml's own quick section over it: same stages, variants, seeds and setting,
    a tiny size; it runs end to end on the CPU (on the test corpus here; on the wide corpus in docs/study.md)
    and its report sets (a) and (a′) beside the study named by compare_with."""
    import copy

    gpu, quick = load_spec("gpu"), load_spec("gpu", quick=True)
    assert gpu["data_dir"] == quick["data_dir"] == "wide" and quick["name"] == "gpu-quick"
    for key in ("variants", "seeds"):
        assert gpu["compare"][key] == quick["compare"][key] and gpu["sweep"].get(key) == quick["sweep"].get(key)
    assert gpu["optim"] == quick["optim"] == "paper" and set(quick["sizes"]) == {"d32"}
    assert len(plan(gpu)) == len(plan(quick)) == 4 * 3 + 4 * 3
    with pytest.raises(ConfigError, match="no 'quick' section"):
        load_spec("full", quick=True)
    spec = copy.deepcopy(quick)
    spec.update(data_dir=str(data_dir), compare={**spec["compare"], "seeds": [0, 1]},
                sweep={**spec["sweep"], "steps": 3, "lrs": [1e-2]}, budget={**spec["budget"], "steps": 4, "seq_len": 32},
                sizes={"d32": {"preset": "debug"}}, timing={"rounds": 1, "warmup": 1, "steps": 1})
    spec.pop("train")
    path = tmp_path / "gq.yaml"
    path.write_text(yaml.safe_dump(spec))
    assert _run(path, tmp_path, "--stages", "sweep,compare", "--skip-eval") == 0
    report = (tmp_path / "res" / "report.md").read_text()
    assert "### (a) and (a′) at both scales" in report and "| full | d128, 2.36M tokens per run, 3 seeds |" in report


def test_the_runner_trains_what_the_sweep_resolution_asks_for(tmp_path, data_dir):
    """With sweep.resolve the runner plans the extra sweep runs once a variant's grid is done, and its comparison
    waits until they are: the pick is the mean over every seed of the lrs near the best."""
    spec = load_spec(write_spec(tmp_path / "s.yaml", data_dir))
    spec["sweep"]["resolve"] = {"seeds": [1], "within": 100.0, "extend": 1}
    study = Study(spec, tmp_path / "res", tmp_path / "scratch", log=lambda m: None)
    study.run(("sweep",))
    names = {p.stem for p in (tmp_path / "res" / "runs").glob("sweep-*.json")}
    for v in ("dense", "stem-1_3"):
        assert {f"sweep-d64-{v}-lr0.003-seed1", f"sweep-d64-{v}-lr0.03-seed1"} <= names
    assert all(b["seeds"] == 2 for b in study.tuned.values()) and set(study.tuned) == {"dense", "stem-1/3"}
    assert not any(r.pending for r in study.runs if r.stage == "compare")


def test_cli_quick_with_a_spec_plans_that_specs_quick_section(capsys, tmp_path):
    """`stemlm study plan --spec gpu --quick` plans gpu.yaml's quick section; `--quick` alone is the quick spec."""
    assert main(["study", "plan", "--spec", "gpu", "--quick", "--results", str(tmp_path / "r"),
                 "--scratch", str(tmp_path / "s")]) == 0
    out = capsys.readouterr().out
    assert "sweep-d32-dense-lr0.01-seed0" in out and "d384" not in out
    assert main(["study", "plan", "--quick", "--results", str(tmp_path / "q"), "--scratch", str(tmp_path / "s")]) == 0
    assert "hash_moe" in capsys.readouterr().out  # the quick spec, not gpu's
