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

**Needle** (``needle_probe``). Every haystack holds the needle ("The pass key is K. …") and a decoy
of the same shape with another key of the same kind ("The room number is D. …", at its own random
depth), so both keys occur twice in the context. After the question "What is the pass key? The pass key
is" the probe reads three things:

* ``margin = log p(K) − log p(D)``: *retrieval*. A model that merely repeats keys it has seen
  (the copy that any language model learns early) favours K and D alike, so its margin is ≈ 0;
  only a model that finds the key the question asks for has ``margin > 0``;
* ``retrieved``: whether greedy decoding gives exactly K (the eval task's accuracy);
* ``gain = log p(K | needle and decoy) − log p(K | decoy only)``: the needle's gain. It rewards
  repetition as much as retrieval (an untreated model gains from seeing K at all), so it is
  reported, never judged.
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


DECOY = "The room number is {key}. Remember it. {key} is the room number."


# a key: a 5-digit number (the eval task's), one token of the tokenizer's numbers of ≥ 2 digits, or one token of
# its lowercase words of ≥ 4 letters
KEY_KINDS = {"number": None, "token-number": r"Ġ[0-9]{2,}", "token-word": r"Ġ[a-z]{4,}"}


def one_token_values(tokenizer_json: str | Path, pattern: str) -> list[str]:
    """The strings that are one token after a space in the tokenizer (BPE's ``Ġ…``) and match ``pattern``
    (on the token, ``Ġ`` included), sorted. A key of one token is retrieved or not in one step; a 5-digit
    number must also be copied digit by digit, which a d128 model learns much later than finding it
    (docs/study.md)."""
    import json
    import re

    vocab = json.loads(Path(tokenizer_json).read_text())["model"]["vocab"]
    values = sorted({t[1:] for t in vocab if re.fullmatch(pattern, t)})
    if len(values) < 20:
        raise ValueError(f"{tokenizer_json} has only {len(values)} one-token keys matching {pattern}; the needle "
                         "probe needs at least 20 (use key: number)")
    return values


def needle_values(kind: str, tokenizer_json: str | Path) -> list[str] | None:
    """The values of the needle probe's keys of ``kind`` (``KEY_KINDS``): None for 5-digit numbers."""
    if kind not in KEY_KINDS:
        raise ValueError(f"needle probe key {kind!r}: choose one of {', '.join(KEY_KINDS)}")
    return None if KEY_KINDS[kind] is None else one_token_values(tokenizer_json, KEY_KINDS[kind])


def key_drawer(values: list[str] | None):
    """``draw(rng)``: a key among ``values`` (None: a 5-digit number, the eval task's ``five_digit_key``)."""
    from ..eval.tasks.needle import five_digit_key

    if values is None:
        return five_digit_key
    return lambda rng: values[int(rng.integers(len(values)))]


def decoy_items(items: list[dict], seed: int, values: list[str] | None = None) -> list[dict]:
    """``items`` of ``needle_trials`` with a decoy each: ``decoy`` (a key of the same kind ≠ the key, from
    ``values`` or a 5-digit number), ``decoy_depth``, ``both`` (the haystack with the decoy and the needle)
    and ``decoy_only`` (with the decoy alone)."""
    import numpy as np

    from ..eval.tasks.needle import DEPTHS, NEEDLE, insert_needle

    rng, draw = np.random.default_rng([seed, 11]), key_drawer(values)
    out = []
    for it in items:
        decoy, depth = draw(rng), float(rng.choice(DEPTHS))  # the decoy at one of the needle's depths
        while decoy == it["key"]:
            decoy = draw(rng)
        decoy_only = insert_needle(it["haystack"], DECOY.format(key=decoy), depth)
        out.append({**it, "decoy": decoy, "decoy_depth": depth, "decoy_only": decoy_only,
                    "both": insert_needle(decoy_only, NEEDLE.format(key=it["key"]), it["depth"])})
    return out


def needle_probe(lm: LanguageModel, trials: int = 4, seed: int = 0, lengths: list[int] | None = None,
                 depths: tuple[float, ...] | None = None, values: list[str] | None = None) -> dict:
    """Retrieval of the pass key against a decoy, per (depth, length) cell and overall: ``margin``
    (log p(key) − log p(decoy), nats), ``retrieval`` (greedy exact match of the key, fraction) and the
    needle's ``gain`` (reported, not a retrieval measure: see the module docstring). Keys are drawn from
    ``values`` (``needle_values``), or are 5-digit numbers when it is None."""
    from ..eval.tasks.needle import DEPTHS, QUESTION, needle_trials

    depths = tuple(depths or DEPTHS)
    longest = max(values, key=len) if values else 12345
    _, lengths, items = needle_trials(lm, trials, seed, depths, lengths, extra=DECOY.format(key=longest),
                                      draw_key=key_drawer(values))
    items = decoy_items(items, seed, values)
    requests = [LoglikelihoodRequest(it[ctx] + QUESTION, f" {it[ans]}") for it in items
                for ctx, ans in (("both", "key"), ("both", "decoy"), ("decoy_only", "key"))]
    answers = lm.loglikelihood(requests)
    key, decoy, alone = answers[0::3], answers[1::3], answers[2::3]
    per_item = {"margin": [k.logprob - d.logprob for k, d in zip(key, decoy)],
                "retrieved": [float(k.is_greedy) for k in key],
                "gain": [k.logprob - a.logprob for k, a in zip(key, alone)]}
    cells = [(it["depth"], it["length"]) for it in items]

    def grid(xs: list[float]) -> list[list[float]]:
        return [[mean_or_nan([x for x, c in zip(xs, cells) if c == (d, n)]) for n in lengths] for d in depths]

    by_length = {str(n): one_sample([g for g, it in zip(per_item["margin"], items) if it["length"] == n]).to_dict()
                 for n in lengths}
    return {"version": 2, "key": "5-digit number" if values is None else f"one of {len(values)} one-token keys",
            "depths": list(depths), "lengths": lengths, "trials": trials,
            "margin": grid(per_item["margin"]), "retrieval": grid(per_item["retrieved"]),
            "gain": grid(per_item["gain"]), "by_length": by_length,
            "mean_margin": one_sample(per_item["margin"], "items").to_dict(),
            "retrieved": {"mean": mean_or_nan(per_item["retrieved"]), "n": len(items)},
            "mean_gain": one_sample(per_item["gain"], "items").to_dict(),
            "with": mean_or_nan([k.logprob for k in key]), "decoy": mean_or_nan([d.logprob for d in decoy]),
            "without": mean_or_nan([a.logprob for a in alone])}


def needle_score(probe: dict, measure: str = "margin") -> float | None:
    """A model's mean needle ``margin`` (retrieval, nats; the default) or ``gain`` (nats), or None (an
    earlier probe without that measure)."""
    return ((probe or {}).get(f"mean_{measure}") or {}).get("mean")


def needle_retrieval(probe: dict) -> float | None:
    """The fraction of trials whose key greedy decoding retrieved exactly, or None."""
    return ((probe or {}).get("retrieved") or {}).get("mean")


def mean_or_nan(xs) -> float:
    """The mean of ``xs`` (a sequence of numbers), NaN when there are none (shown, never judged)."""
    xs = list(xs)
    return sum(xs) / len(xs) if xs else float("nan")


def lm_for(model, data_dir: str | Path, max_length: int | None = None, batch_size: int = 64) -> LanguageModel:
    """An eval ``EvalEngine`` over an in-memory ``model`` with the tokenizer of its data dir."""
    from ..data.codec import load_codec
    from ..eval.engine import EvalEngine

    tokens = load_codec(tokenizer=Path(data_dir) / "tokenizer.json")
    return EvalEngine(model.eval(), tokens, max_length=max_length or model.cfg.max_seq_len, batch_size=batch_size,
                  identity="study-probe")


def passkey_documents(n_docs: int, length_chars: int, seed: int = 0, values: list[str] | None = None) -> list[str]:
    """Pass-key retrieval documents for the needle probe's positive control: a haystack of 16 to
    ``length_chars`` characters (uniform: short ones teach the copy fastest) holding the needle and a
    decoy of the same shape (``DECOY``) at random depths, then the question and the key (drawn from
    ``values``, or 5-digit numbers). The decoy makes copying any key useless: only finding the one the
    question asks for lowers the loss."""
    import numpy as np

    from ..eval.tasks.needle import NEEDLE, QUESTION, haystack, haystack_passages, insert_needle

    passages, rng, draw = haystack_passages(), np.random.default_rng([seed, 7]), key_drawer(values)
    docs = []
    for _ in range(n_docs):
        key, start, depth = draw(rng), int(rng.integers(len(passages))), float(rng.random())
        decoy, decoy_depth = draw(rng), float(rng.random())
        hay = insert_needle(haystack(passages, start, int(rng.integers(16, length_chars))), DECOY.format(key=decoy),
                            decoy_depth)
        docs.append(insert_needle(hay, NEEDLE.format(key=key), depth) + QUESTION + f" {key}.")
    return docs
