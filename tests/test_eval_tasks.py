"""Task loaders on the real pinned files, and tasks scored by a tiny debug model through ReferenceLM."""

import pytest
import torch

from stemlm import StemLM, model_config
from stemlm.checkpoint.directory import save_model
from stemlm.data import facts as facts_mod
from stemlm.data.corpus import boolq_passages
from stemlm.data.tokenizer import train_bpe
from stemlm.eval.api import LoglikelihoodRequest, encode_pair
from stemlm.eval.models import load_lm
from stemlm.eval.tasks import GROUPS, TASKS, resolve_tasks
from stemlm.eval.tasks.base import subsample
from stemlm.eval.tasks.country_facts import PROBES, probe_items
from stemlm.eval.tasks.mmlu import SUBJECTS, mmlu_prompt, subject_items
from stemlm.eval.tasks.needle import NEEDLE, context_lengths, insert_needle
from stemlm.eval.tasks.qa import qa_pairs, qa_prompt
from train_helpers import one_thread  # noqa: F401

QUESTIONS = {"arc_easy": 570, "arc_challenge": 299, "boolq": 3270, "piqa": 1838, "socialiqa": 1954,
             "hellaswag": 10042, "openbookqa": 500, "winogrande": 1267, "csqa": 1221, "sciq": 1000}


@pytest.mark.parametrize("name", GROUPS["core"])
def test_multiple_choice_files_give_well_formed_questions(name):
    items = TASKS[name].items(0)
    assert len(items) == QUESTIONS[name]
    for it in items:
        assert len(it.continuations) >= 2 and 0 <= it.gold < len(it.continuations)
        assert len(it.contexts) == len(it.continuations) and all(c.strip() for c in it.contexts)
        assert all(x.startswith(" ") and x.strip() for x in it.continuations)
        assert it.uncond_contexts is None or set(it.uncond_contexts) == {"Answer:"}
    assert (items[0].uncond_contexts is None) == (name in ("boolq", "winogrande"))
    five = TASKS[name].items(5)
    assert five and len(five[0].contexts[0]) > len(items[0].contexts[0])  # solved examples come first


def test_bpb_files_give_one_gold_continuation_per_item():
    for name in GROUPS["bpb"]:
        reqs = TASKS[name].requests()
        assert reqs and all(r.continuation.strip() and isinstance(d, int) for d, r in reqs), name
    assert len(TASKS["gsm8k_bpb"].requests()) == 1319 and len(TASKS["lambada_bpb"].requests()) == 5153


def test_mmlu_has_57_subjects_and_the_harness_prompt():
    assert len(SUBJECTS) == 57
    items = subject_items("anatomy", 5)
    assert len(items) == 135 and items[0].continuations == (" A", " B", " C", " D")
    ctx = items[0].contexts[0]
    assert ctx.startswith("The following are multiple choice questions (with answers) about anatomy.\n\n"
                          "What is the embryological origin of the hyoid bone?\nA. The first pharyngeal arch\n")
    assert ctx.count("\nAnswer:") == 6 and ctx.endswith("decreased salivation.\nAnswer:")
    assert "\nAnswer: D\n\n" in ctx  # the first dev answer is index 3
    row = {"question": " Q? ", "choices": ["w", "x", "y", "z"], "answer": 2}
    assert mmlu_prompt("high_school_us_history", row, []) == (
        "The following are multiple choice questions (with answers) about high school us history.\n\n"
        "Q?\nA. w\nB. x\nC. y\nD. z\nAnswer:")
    for s in SUBJECTS:
        assert subject_items(s, 0), s


def test_closed_book_qa_items_and_prompt():
    trivia, nq = qa_pairs("trivia_qa"), qa_pairs("nq_open")
    assert len(trivia) == 7993 and len(nq) == 3610
    assert all(q and a for q, a in trivia + nq)
    assert "Sunset Blvd" in trivia[0][1]
    items, shots = TASKS["nq_open"].items(5)
    assert len(shots) == 5 and len(items) == 3610 - 5 and not {q for _, q, _ in items} & {q for q, _ in shots}
    assert qa_prompt("who won?", [("capital of peru", ["Lima"])]) == (
        "Question: capital of peru?\nAnswer: Lima\n\nQuestion: who won?\nAnswer:")


def test_country_probe_phrasings_never_occur_in_the_training_corpus():
    facts = facts_mod.build_facts(facts_mod.load_countries())
    items = probe_items(facts)
    corpus = facts_mod.fact_documents(facts, repeats=1) + boolq_passages()
    marker = "?\nAnswer:"  # every probe ends so; no training document contains it
    assert all(p.endswith(marker) for p in PROBES.values())
    assert not any(marker in doc for doc in corpus)
    fact_text = "\n".join(f["text"] for f in facts)  # every template of every split
    assert not any(it["prompt"].split("\n")[0][len("Question: "):] in fact_text for it in items)
    seen = [it for it in items if it["seen"]]
    unseen = [it for it in items if not it["seen"]]
    held = facts_mod.heldout_countries(facts_mod.load_countries())
    assert seen and unseen and {it["country"] for it in unseen} == held
    for it in items:
        assert it["candidates"][0] == it["answer"] and len(set(it["candidates"])) == len(it["candidates"]) >= 2


def test_needle_geometry():
    assert context_lengths(128) == [64, 128] and context_lengths(8192) == [1024, 2048, 4096, 8192]
    hay = "One fact. Two facts here. Three facts."
    needle = NEEDLE.format(key=12345)
    assert insert_needle(hay, needle, 0.0).startswith(needle)
    assert insert_needle(hay, needle, 1.0).endswith(needle)
    assert f"One fact. Two facts here. {needle} Three" in insert_needle(hay, needle, 0.3)


def test_unknown_task_names_list_the_choices():
    assert [t.name for t in resolve_tasks("core,arc_easy,mmlu")][-1] == "mmlu"
    assert len(resolve_tasks("core,arc_easy")) == 10
    with pytest.raises(ValueError, match="unknown task 'arc'.*core"):
        resolve_tasks("arc")


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    torch.manual_seed(0)
    model = StemLM(model_config("debug", ffn="stem", stem_layers="1/2", max_seq_len=256)).eval()
    path = tmp_path_factory.mktemp("eval_tasks") / "ckpt"
    save_model(model, path)
    train_bpe(boolq_passages()[:200], vocab_size=512).save(str(path / "tokenizer.json"))
    return load_lm(path)


def test_mc_scores_agree_with_the_model_answers(lm):
    result = TASKS["arc_easy"].evaluate(lm, 0, limit=6, seed=0)
    assert result["n"] == 6 and result["chance"] == pytest.approx(0.25) and result["metric"] == "acc"
    picked = subsample(TASKS["arc_easy"].items(0), 6, 0, key=lambda it: f"arc_easy:{it.doc_id}")
    correct = []
    for it in picked:
        lps = [a.logprob for a in lm.loglikelihood([LoglikelihoodRequest(c, x) for c, x in
                                                    zip(it.contexts, it.continuations)])]
        correct.append(float(max(range(len(lps)), key=lambda i: (lps[i], -i)) == it.gold))
    assert result["acc"] == pytest.approx(sum(correct) / 6)
    assert {"acc_norm", "acc_uncond", "acc_stderr"} <= set(result)


class Recording:
    """A LanguageModel that records what it is asked, checking each context fits the model."""

    def __init__(self, lm):
        self.lm, self.identity, self.max_length, self.lengths = lm, lm.identity, lm.max_length, []

    def loglikelihood(self, requests):
        for r in requests:
            ctx, cont = encode_pair(self.lm.tokens, r.context, r.continuation)
            self.lengths.append(len(ctx) + len(cont) - 1)  # tokens the model reads
        return self.lm.loglikelihood(requests)

    def generate_until(self, requests):
        return self.lm.generate_until(requests)


def test_needle_contexts_stay_within_their_nominal_length(lm):
    rec = Recording(lm)
    result = TASKS["needle"].evaluate(rec, 0, limit=1, seed=0)
    grid = result["grid"]
    lengths = grid["lengths"]
    assert lengths[-1] == 256 and set(lengths) <= set(context_lengths(256)) and grid["trials"] == 1
    assert len(grid["acc"]) == 5 and all(len(row) == len(lengths) for row in grid["acc"])
    assert result["n"] == 5 * len(lengths)
    cells = rec.lengths[2:]  # after the two measuring requests: 5 depths x 1 trial per length, in order
    for i, nominal in enumerate(lengths):
        assert 0.5 * nominal < max(cells[5 * i:5 * i + 5]) <= nominal


def test_generative_and_probe_tasks_run_on_a_tiny_model(lm):
    qa = TASKS["trivia_qa"].evaluate(lm, 5, limit=2, seed=0)
    assert qa["n"] == 2 and qa["acc"] == 0.0 and len(qa["samples"]) == 2
    facts = TASKS["country_facts"].evaluate(lm, 0, limit=8, seed=0)
    assert facts["n"] == 8 and facts["n_acc_seen"] + facts["n_acc_unseen"] == 8
    assert 0 <= facts["acc"] <= 1 and set(facts["relations"]) <= set(PROBES)
    bpb = TASKS["lambada_bpb"].evaluate(lm, 0, limit=3, seed=0)
    assert bpb["metric"] == "bpb" and bpb["bpb"] > 1 and "acc" in bpb and bpb["shots"] == 0
