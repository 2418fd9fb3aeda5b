"""lm-eval's ``local-completions`` backend scores a task through stemlm serve as stemlm's own engine does."""

import json

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("lm_eval")

from stemlm.eval.api import encode_pair  # noqa: E402
from stemlm.eval.models import load_lm  # noqa: E402
from stemlm.serve.server import ServerThread, load_served  # noqa: E402

from serve_helpers import tiny_checkpoint  # noqa: E402
from test_eval_harness import _offline  # noqa: E402,F401  (autouse: no hub, a private datasets cache)

DOCS = [{"question": "The capital of France is", "choices": ["Paris", "Madrid", "a cat"], "answer": 0},
        {"question": "Once upon a time there was", "choices": ["a cat", "Spain", "the capital"], "answer": 0},
        {"question": "The capital of Spain is", "choices": ["Paris", "Madrid", "once"], "answer": 1}]


class TextTokens:
    """The text's own ids, no document-start token: how lm-eval tokenizes through ``/tokenize``."""

    prefix_ids: list = []

    def __init__(self, codec):
        self.codec, self.eot_id = codec, codec.eos_id

    def encode(self, text):
        return self.codec.encode(text, special=False)


def write_task(root):
    import yaml

    root.mkdir()
    (root / "mc.jsonl").write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    spec = {"task": "serve_mc", "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(root / "mc.jsonl")}},
            "test_split": "test", "output_type": "multiple_choice", "doc_to_text": "{{question}}",
            "doc_to_choice": "{{choices}}", "doc_to_target": "{{answer}}", "metric_list": [{"metric": "acc"}]}
    (root / "serve_mc.yaml").write_text(yaml.safe_dump(spec))
    return root


def test_local_completions_through_the_server_equals_the_engine(tmp_path):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    ckpt = tiny_checkpoint(tmp_path / "tiny", max_seq_len=64)
    served = load_served(ckpt, max_batch=4)
    with ServerThread(served) as url:
        out = simple_evaluate(model="local-completions",
                              model_args=f"base_url={url}/v1/completions,model=tiny,max_length=63,max_retries=1",
                              tasks=["serve_mc"], task_manager=TaskManager(include_path=str(write_task(tmp_path / "tasks"))),
                              log_samples=True, batch_size=1)
    lm = load_lm(ckpt, batch_size=4)
    tokens = TextTokens(served.codec)
    direct = [lm.score_pairs([encode_pair(tokens, d["question"], " " + c) for c in d["choices"]]) for d in DOCS]
    samples = sorted(out["samples"]["serve_mc"], key=lambda s: s["doc_id"])
    for sample, answers in zip(samples, direct):
        got = [(float(r[0]), bool(r[1])) for r in sample["filtered_resps"]]
        assert [g[0] for g in got] == pytest.approx([a.logprob for a in answers], abs=1e-4)
        assert [g[1] for g in got] == [a.is_greedy for a in answers]
    acc = sum(max(range(3), key=lambda i: a[i].logprob) == d["answer"] for a, d in zip(direct, DOCS)) / len(DOCS)
    assert out["results"]["serve_mc"]["acc,none"] == pytest.approx(acc)
