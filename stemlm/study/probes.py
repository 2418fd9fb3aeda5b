"""Probes that can see the paper's effects at small scale: log-probabilities, not accuracies.

**Knowledge** (``knowledge_probe``). For every country fact whose answer is the object (" Madrid"
in "The capital of Spain is"), the log-probability of the gold answer, contrasted with the same
answer after the prompt of a never-trained country (the country swapped for one of the held-out
countries whose answer differs): ``c = log p(a | prompt(country)) − log p(a | prompt(held-out
country))``. The contrast removes the answer's prior (a frequent answer such as " Europe" is likely
after any prompt). It is measured for *seen* countries (their facts are in the training text) and
*unseen* ones (held out: nothing about them is), in three families of prompts: the training
templates, the held-out template of each relation, and the country_facts question phrasing. A
model that stored facts has ``seen − unseen > 0``; one that did not has ≈ 0 (a model trained on
the facts alone is the positive control, the model at its init the negative one).

**Needle** (``needle_probe``). For each context length and depth, the log-probability of the pass
key after the question, with the needle in the haystack and without it (the same haystack):
``gain = log p(key | with) − log p(key | without)``. A model that copies from its context has
``gain > 0`` even long before it retrieves the whole key greedily.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from ..eval.api import LanguageModel, LoglikelihoodRequest
from .stats import difference, one_sample

FAMILIES = ("train", "heldout", "question")
EXCLUDED_RELATIONS = ("borders",)  # list answers


def _question_prompts() -> dict[str, str]:
    from ..eval.tasks.country_facts import PROBES
    return PROBES


def knowledge_items(facts: list[dict]) -> list[dict]:
    """``{"family", "relation", "country", "seen", "prompt", "partner_prompt", "answer"}`` per probe item.

    ``facts``: rows of ``stemlm.data.facts.build_facts`` (or a data dir's ``facts.jsonl``)."""
    facts = [f for f in facts if f["relation"] not in EXCLUDED_RELATIONS]
    held = sorted({f["country"] for f in facts if f["split"] == "heldout_country"})
    if not held:
        raise ValueError("the facts hold no held-out country: the knowledge probe needs unseen countries")
    last: dict[str, int] = {}
    for f in facts:
        last[f["relation"]] = max(last.get(f["relation"], 0), f["template_id"])
    objects = {(f["country"], f["relation"]): f["object"] for f in facts}
    by_key = {(f["country"], f["relation"], f["template_id"]): f for f in facts}
    questions = _question_prompts()
    items = []
    for f in facts:
        if f["answer_is"] != "object":
            continue
        partner = _partner(f["country"], f["relation"], f["object"], held, objects)
        if partner is None:
            continue
        family = "heldout" if f["template_id"] == last[f["relation"]] else "train"
        items.append({"family": family, "relation": f["relation"], "country": f["country"],
                      "seen": f["split"] != "heldout_country", "prompt": f["prompt"], "answer": f["answer"],
                      "partner_prompt": by_key[(partner, f["relation"], f["template_id"])]["prompt"]})
        if f["template_id"] == 0 and f["relation"] in questions:
            q = questions[f["relation"]]
            items.append({"family": "question", "relation": f["relation"], "country": f["country"],
                          "seen": f["split"] != "heldout_country", "prompt": q.format(s=f["country"]),
                          "answer": f["answer"], "partner_prompt": q.format(s=partner)})
    return items


def _partner(country: str, relation: str, obj: str, held: list[str], objects: dict) -> str | None:
    """A held-out country (not ``country``) with a different answer for ``relation``, fixed per fact."""
    options = [h for h in held if h != country and (h, relation) in objects and objects[(h, relation)] != obj]
    if not options:
        return None
    digest = int(hashlib.sha256(f"{country}:{relation}".encode()).hexdigest(), 16)
    return options[digest % len(options)]


def knowledge_probe(lm: LanguageModel, facts: list[dict], limit: int | None = None) -> dict:
    """Per family: mean contrast of seen and of unseen items and their difference (Welch, over items).

    ``limit`` keeps ``limit`` items of each family and split, picked by a hash of the item (the same
    items for every model)."""
    items = knowledge_items(facts)
    if limit:
        kept, counts = [], {}
        order = sorted(items, key=lambda it: hashlib.sha256(
            f"{it['family']}:{it['country']}:{it['relation']}:{it['prompt']}".encode()).hexdigest())
        for it in order:
            key = (it["family"], it["seen"])
            if counts.get(key, 0) < limit:
                counts[key] = counts.get(key, 0) + 1
                kept.append(it)
        items = kept
    requests = [LoglikelihoodRequest(p, it["answer"]) for it in items for p in (it["prompt"], it["partner_prompt"])]
    scores = [a.logprob for a in lm.loglikelihood(requests)]
    out = {}
    for family in FAMILIES:
        rows = [(it, scores[2 * i], scores[2 * i + 1]) for i, it in enumerate(items) if it["family"] == family]
        seen = [g - p for it, g, p in rows if it["seen"]]
        unseen = [g - p for it, g, p in rows if not it["seen"]]
        if len(seen) < 2 or len(unseen) < 2:
            continue
        gold_seen = [g for it, g, _ in rows if it["seen"]]
        gold_unseen = [g for it, g, _ in rows if not it["seen"]]
        out[family] = {"seen": sum(seen) / len(seen), "unseen": sum(unseen) / len(unseen),
                       "n_seen": len(seen), "n_unseen": len(unseen),
                       "gold_seen": sum(gold_seen) / len(gold_seen), "gold_unseen": sum(gold_unseen) / len(gold_unseen),
                       "seen_minus_unseen": difference(seen, unseen).to_dict()}
    return {"families": out, "n_items": len(items)}


def probe_of(result: dict, kind: str) -> dict | None:
    """The ``kind`` probe of a run result, or None (not measured, or skipped for want of data)."""
    p = (result.get("probes") or {}).get(kind)
    return None if not p or "skipped" in p else p


def knowledge_score(probe: dict, family: str = "train") -> float | None:
    """A model's knowledge by the probe: mean contrast of seen minus unseen items in ``family``."""
    f = (probe or {}).get("families", {}).get(family)
    return None if f is None else f["seen"] - f["unseen"]


def needle_probe(lm: LanguageModel, trials: int = 4, seed: int = 0, lengths: list[int] | None = None,
                 depths: tuple[float, ...] | None = None) -> dict:
    """Gain in the key's log-probability from having the needle in context, per (depth, length) cell
    and overall (mean over trials with its interval)."""
    from ..eval.tasks.needle import DEPTHS, QUESTION, needle_trials

    depths = tuple(depths or DEPTHS)
    _, lengths, items = needle_trials(lm, trials, seed, depths, lengths)
    requests = [LoglikelihoodRequest(c + QUESTION, f" {it['key']}") for it in items for c in (it["context"], it["haystack"])]
    scores = [a.logprob for a in lm.loglikelihood(requests)]
    gains = [scores[2 * i] - scores[2 * i + 1] for i in range(len(items))]
    grid = [[_mean([g for g, it in zip(gains, items) if (it["depth"], it["length"]) == (d, n)]) for n in lengths]
            for d in depths]
    by_length = {str(n): one_sample([g for g, it in zip(gains, items) if it["length"] == n]).to_dict() for n in lengths}
    return {"depths": list(depths), "lengths": lengths, "trials": trials, "gain": grid, "by_length": by_length,
            "mean_gain": one_sample(gains, "items").to_dict(), "with": _mean(scores[0::2]), "without": _mean(scores[1::2])}


def needle_score(probe: dict) -> float | None:
    """A model's mean needle gain (nats), or None."""
    return ((probe or {}).get("mean_gain") or {}).get("mean")


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def lm_for(model, data_dir: str | Path, max_length: int | None = None, batch_size: int = 64) -> LanguageModel:
    """An eval ``EvalEngine`` over an in-memory ``model`` with the tokenizer of its data dir."""
    from ..data.codec import load_codec
    from ..eval.engine import EvalEngine

    tokens = load_codec(tokenizer=Path(data_dir) / "tokenizer.json")
    return EvalEngine(model.eval(), tokens, max_length=max_length or model.cfg.max_seq_len, batch_size=batch_size,
                  identity="study-probe")


def passkey_documents(n_docs: int, length_chars: int, seed: int = 0) -> list[str]:
    """Pass-key retrieval documents for the needle probe's positive control: a haystack of 16 to
    ``length_chars`` characters (uniform: short ones teach the copy fastest) with the needle at a
    random depth, then the question and the key."""
    import numpy as np

    from ..eval.tasks.needle import NEEDLE, QUESTION, haystack, haystack_passages, insert_needle

    passages, rng = haystack_passages(), np.random.default_rng([seed, 7])
    docs = []
    for _ in range(n_docs):
        key, start, depth = int(rng.integers(10000, 100000)), int(rng.integers(len(passages))), float(rng.random())
        hay = haystack(passages, start, int(rng.integers(16, length_chars)))
        docs.append(insert_needle(hay, NEEDLE.format(key=key), depth) + QUESTION + f" {key}.")
    return docs
