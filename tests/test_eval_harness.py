"""lm-evaluation-harness runs local tasks with ``--model stemlm`` and reports what the engine computes."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("lm_eval")

from stemlm import StemLM, model_config  # noqa: E402
from stemlm.checkpoint.directory import save_model  # noqa: E402
from stemlm.data.tokenizer import train_bpe  # noqa: E402
from stemlm.eval import models as eval_models  # noqa: E402
from stemlm.eval.api import GenerateRequest, LoglikelihoodRequest  # noqa: E402
from stemlm.eval.harness import StemHarnessLM, register  # noqa: E402
from stemlm.eval.models import load_lm  # noqa: E402

TEXTS = ["The capital of France is Paris.", "A dog ran in the park and sat on the mat.",
         "Question: what is two plus two? Answer: four."] * 20
MC = [{"question": "The capital of France is", "choices": ["Paris", "the mat", "four"], "answer": 0},
      {"question": "Question: what is two plus two? Answer:", "choices": ["four", "a dog", "Paris and the park"],
       "answer": 0},
      {"question": "A dog ran in the", "choices": ["park", "capital", "mat"], "answer": 2}]
GEN = [{"question": "The capital of", "answer": "France"}, {"question": "A dog ran", "answer": "in"}]
ROLLING = [{"text": " ".join(TEXTS[:5])}, {"text": "Paris."}]
TASKS = {
    "tiny_mc": {"output_type": "multiple_choice", "doc_to_text": "{{question}}", "doc_to_choice": "{{choices}}",
                "doc_to_target": "{{answer}}", "metric_list": [{"metric": "acc"}]},
    "tiny_gen": {"output_type": "generate_until", "doc_to_text": "{{question}}", "doc_to_target": "{{answer}}",
                 "generation_kwargs": {"until": ["."], "max_gen_toks": 6, "do_sample": False},
                 "metric_list": [{"metric": "exact_match"}]},
    "tiny_rolling": {"output_type": "loglikelihood_rolling", "doc_to_text": "", "doc_to_target": "{{text}}",
                     "metric_list": [{"metric": "word_perplexity"}]},
}


def write_tasks(root: Path) -> Path:
    """Task YAMLs (local json data files, no hub) as ``--include_path`` reads them."""
    import yaml

    root.mkdir(parents=True, exist_ok=True)
    for name, docs in (("tiny_mc", MC), ("tiny_gen", GEN), ("tiny_rolling", ROLLING)):
        data = root / f"{name}.jsonl"
        data.write_text("".join(json.dumps(d) + "\n" for d in docs))
        spec = {"task": name, "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(data)}},
                "test_split": "test", **TASKS[name]}
        (root / f"{name}.yaml").write_text(yaml.safe_dump(spec))
    return root


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("harness")
    torch.manual_seed(0)
    save_model(StemLM(model_config("debug", ffn="stem", stem_layers="1/2", max_seq_len=32)).eval(), root / "ckpt")
    train_bpe(TEXTS, vocab_size=300).save(str(root / "ckpt" / "tokenizer.json"))
    return root / "ckpt", write_tasks(root / "tasks")


@pytest.fixture(autouse=True)
def _offline(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    monkeypatch.setattr(eval_models, "DIGEST_CACHE", tmp_path / "digests.json")


def engine_answers(ckpt, tables="device"):
    """What the engine says directly about the same requests."""
    lm = load_lm(ckpt, tables, batch_size=4)
    mc = [lm.loglikelihood([LoglikelihoodRequest(d["question"], " " + c) for c in d["choices"]]) for d in MC]
    gen = lm.generate_until([GenerateRequest(d["question"], (".",), 6) for d in GEN])
    rolling = lm.loglikelihood_rolling([d["text"] for d in ROLLING])
    return mc, gen, rolling


@pytest.mark.parametrize("tables", ["device", "disk"])
def test_simple_evaluate_reports_the_engine_numbers(setup, tables):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    ckpt, tasks = setup
    register()
    out = simple_evaluate(model="stemlm", model_args=f"pretrained={ckpt},tables={tables}", tasks=list(TASKS),
                          batch_size=4, task_manager=TaskManager(include_path=str(tasks)), log_samples=True)
    mc, gen, rolling = engine_answers(ckpt, tables)
    samples = {k: sorted(v, key=lambda s: s["doc_id"]) for k, v in out["samples"].items()}
    for sample, answers in zip(samples["tiny_mc"], mc):
        got = [float(r[0]) for r in sample["filtered_resps"]]
        assert got == pytest.approx([a.logprob for a in answers], abs=1e-5)
    acc = sum(max(range(3), key=lambda i: a[i].logprob) == d["answer"] for a, d in zip(mc, MC)) / len(MC)
    assert out["results"]["tiny_mc"]["acc,none"] == pytest.approx(acc)
    assert [s["filtered_resps"][0] for s in samples["tiny_gen"]] == gen
    assert [s["resps"][0][0] for s in samples["tiny_rolling"]] == pytest.approx([a.logprob for a in rolling], abs=1e-5)
    assert out["config"]["model_identity"] == load_lm(ckpt).identity


def test_command_line_runs_the_harness_with_stemlm(setup, tmp_path):
    ckpt, tasks = setup
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "stemlm.eval.harness", "--model", "stemlm", "--model_args",
           f"pretrained={ckpt},tables=host", "--tasks", "tiny_mc,tiny_gen", "--include_path", str(tasks),
           "--batch_size", "2", "--output_path", str(tmp_path / "out")]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(next((tmp_path / "out").rglob("results_*.json")).read_text())
    mc, gen, _ = engine_answers(ckpt)
    acc = sum(max(range(3), key=lambda i: a[i].logprob) == d["answer"] for a, d in zip(mc, MC)) / len(MC)
    assert result["results"]["tiny_mc"]["acc,none"] == pytest.approx(acc)
    assert result["results"]["tiny_gen"]["exact_match,none"] == sum(g == d["answer"] for g, d in zip(gen, GEN)) / 2


def test_sampling_is_refused(setup):
    ckpt, _ = setup
    lm = StemHarnessLM(pretrained=str(ckpt))
    with pytest.raises(ValueError, match="decodes greedily"):
        lm._generate_request("The capital", {"do_sample": True, "temperature": 0.7})
