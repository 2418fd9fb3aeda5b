"""Knowledge injection and removal, measured on country facts.

**Injection**: a *new* entity — a country whose facts were held out of training, or a token that
never occurs in the training data — receives the table rows of a *known* country K (``inject``).
A case is one fact prompt of K the unedited model answers correctly, rewritten with the new
entity's tokens in place of K's ("The capital of Spain is" -> "The capital of Ghana is"); it
succeeds when the edited model's top-1 next token is the first token of K's answer. The same
prompts on the unedited model give the baseline (``success_before``).

**Removal**: a known country's rows are replaced by a neutral row (``forget``: the table's mean
row, zeros, or the mean row of other entities); a case is one of its known facts, and it counts
as *forgotten* when the answer's first token is no longer the top-1 prediction.

Locality and reversibility are measured as in ``evaluate.py``.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import numpy as np

from ..data.codec import TextCodec
from .evaluate import EditEvaluator, _Tally
from .ops import forget, inject
from .probes import Probe


def unused_tokens(counts: np.ndarray, tokenizer, n: int, seed: int = 0) -> list[int]:
    """Up to ``n`` token ids that never occur in the training split and read as a word piece
    with a leading space (" Xyz"): stand-ins for a made-up name (seeded sample)."""
    codec = TextCodec.of(tokenizer)
    special = codec.special_ids
    pool = []
    for tid in np.flatnonzero(np.asarray(counts) == 0).tolist():
        text = codec.token_text(tid)
        if tid not in special and text.startswith(" ") and text[1:].isalpha() and len(text) > 3:
            pool.append(tid)
    return random.Random(seed).sample(pool, min(n, len(pool)))


def _replace(ids: Sequence[int], old: Sequence[int], new: Sequence[int]) -> tuple[int, ...]:
    """``ids`` with the first occurrence of the run ``old`` replaced by ``new``."""
    ids, k = list(ids), len(old)
    for i in range(len(ids) - k + 1):
        if ids[i:i + k] == list(old):
            return tuple(ids[:i] + list(new) + ids[i + k:])
    raise ValueError(f"entity ids {list(old)} do not occur in prompt ids {ids}")


def _known_probes(ev: EditEvaluator, country: str) -> list[Probe]:
    return [p for p in ev.probes.get(country, []) if ev.known[(p.country, p.key)][0]]


def _summary(tally: _Tally, extra: dict) -> dict:
    out = tally.summary()
    keep = ("known", "success", "prob_target_before", "prob_target_after", "prob_shift", "locality_n",
            "locality_top1", "locality_kl", "text_locality_top1", "text_locality_kl", "edits", "reversible",
            "by_relation", "by_length")
    return {**extra, **{k: out[k] for k in keep}}


def run_injection(ev: EditEvaluator, new_entities: dict[str, list[int]], *, strategy: str = "auto",
                  layers=None, align: str = "left", seed: int = 0) -> dict:
    """Inject known countries into new entities (name -> token ids); metrics as in the module doc."""
    rng = random.Random(seed)
    donors = [c for c in sorted(ev.probes) if _known_probes(ev, c) and c not in new_entities]
    if not donors:
        raise ValueError("the unedited model knows no fact of the split: nothing to inject")
    tally, before_ok = _Tally(), 0
    for name, new_ids in new_entities.items():
        donor = rng.choice(donors)
        probes = _known_probes(ev, donor)
        prompts = [_replace(p.prompt_ids, ev.entity[donor], new_ids) for p in probes]
        answers = [p.answer_ids for p in probes]
        apply = lambda: inject(ev.model, new_ids, ev.entity[donor], strategy=strategy, layers=layers,  # noqa: E731
                               align=align, filler=ev.filler)
        before, after = ev.measure(prompts, answers, apply, (donor, name), tally)
        length = "equal" if len(new_ids) == len(ev.entity[donor]) else "unequal"
        p_before, p_after = before.probs(), after.probs()
        for i, p in enumerate(probes):
            before_ok += bool(before.first_ok[i])
            tally.add_success(p.answer_ids[0], bool(after.first_ok[i]), p_before[i], p_after[i], (p.relation, length))
    return _summary(tally, {"strategy": strategy, "align": align, "layers": layers, "entities": len(new_entities),
                            "success_before": before_ok / tally.n["known"] if tally.n["known"] else None})


def run_forget(ev: EditEvaluator, countries: Sequence[str], *, replacement="mean", layers=None) -> dict:
    """Remove each country's facts by overwriting its rows; ``success`` = fraction forgotten."""
    tally = _Tally()
    for country in countries:
        probes = _known_probes(ev, country)
        if not probes:
            continue
        prompts, answers = [p.prompt_ids for p in probes], [p.answer_ids for p in probes]
        apply = lambda: forget(ev.model, ev.entity[country], replacement=replacement, layers=layers)  # noqa: E731
        before, after = ev.measure(prompts, answers, apply, (country,), tally)
        p_before, p_after = before.probs(), after.probs()
        for i, p in enumerate(probes):
            tally.add_success(p.answer_ids[0], not bool(after.first_ok[i]), p_before[i], p_after[i], (p.relation, "-"))
    label = replacement if isinstance(replacement, str) else f"mean of {len(replacement)} rows"
    return _summary(tally, {"replacement": label, "layers": layers, "countries": len(countries)})
