"""Edit evaluation over country facts: success, probability shift, locality, reversibility.

For a pair of countries (A, B) the edit gives A the table rows of B (``mode="copy"``) or
exchanges them (``mode="swap"``, both directions are scored). A *case* is one fact prompt of A
("The capital of A is") whose expected answer after the edit is B's answer to the same
question (same relation, same template). Metrics (all per strategy and per layer set):

* **success** — the first token of B's answer is the edited model's top-1 next token. Cases
  count only when the *unedited* model already gets both facts right (A's prompt -> A's answer
  and B's prompt -> B's answer) and the two answers start with different tokens; ``known`` is
  that denominator, ``cases`` the number before the knowledge filter.
  **success_full** uses the whole answer instead: every answer token top-1 given the gold
  prefix (= greedy decoding reproduces B's full answer), with the same filter on full answers.
* **prob_shift** — mean over known cases of p_edited(first token of B's answer) minus
  p_unedited(same token), both after A's prompt.
* **locality** — over facts of *other* countries (a fixed seeded sample): fraction whose top-1
  next token is unchanged, and mean KL(unedited || edited) of the next-token distribution.
* **text locality** (optional, ``text=`` ids of unrelated text such as the validation split):
  fraction of all text positions whose top-1 next token is unchanged, and the mean KL there.
* **reversible** — fraction of edits after whose undo the logits of every scored prompt are
  bitwise equal to the logits before the edit.
"""

from __future__ import annotations

import random
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field

import torch
from tqdm import tqdm

from .ops import edit, resolve_filler
from .probes import Probe, build_probes
from .rows import num_rows, resolve_layers
from .scoring import kl_divergence, score
from .strategies import check_strategy
from .tokens import entity_ids


@dataclass
class EditEvalConfig:
    """What to evaluate; ``layer_sets`` maps a label to layer indices (``None`` = all tables)."""

    split: str = "heldout_template"
    strategies: tuple[str, ...] = ("auto",)
    align: str = "left"
    mode: str = "swap"
    n_pairs: int = 50
    n_locality: int = 64
    seed: int = 0
    filler: int | str | None = None
    layer_sets: dict[str, list[int] | None] = field(default_factory=lambda: {"all": None})
    relations: tuple[str, ...] | None = None
    embedding: bool = False  # also swap the input-embedding rows (diagnostic upper bound, not a STEM edit)
    protect_shared: bool = False  # leave the rows of tokens that two or more names hold (" United", " Guinea")


def layer_sweep(model) -> dict[str, list[int]]:
    """Layer sets for ``--layers-sweep``: the first k and the last k table layers, k = 1..|S|."""
    layers = resolve_layers(model)
    sets = {"all": layers}
    for k in range(1, len(layers)):
        sets[f"first{k}"] = layers[:k]
        sets[f"last{k}"] = layers[-k:]
    return sets


class _Tally:
    """Running sums of one run's metrics."""

    def __init__(self):
        self.n = defaultdict(float)
        self.by_relation = defaultdict(lambda: [0, 0])
        self.by_length = defaultdict(lambda: [0, 0])

    def add(self, key: str, value: float = 1.0):
        self.n[key] += value

    def add_success(self, token: int, ok: bool, p_before: torch.Tensor, p_after: torch.Tensor,
                    groups: tuple[str, str]) -> None:
        """One known case: its success and the probability of the expected first token."""
        self.add("known")
        self.add("success", ok)
        self.add("p_before", float(p_before[token]))
        self.add("p_after", float(p_after[token]))
        self.add("p_shift", float(p_after[token] - p_before[token]))
        for table, key in zip((self.by_relation, self.by_length), groups):
            table[key][0] += 1
            table[key][1] += ok

    def rate(self, num: str, den: str) -> float | None:
        return self.n[num] / self.n[den] if self.n[den] else None

    def summary(self) -> dict:
        out = {"pairs": int(self.n["pairs"]), "skipped_pairs": int(self.n["skipped"]),
               "cases": int(self.n["cases"]), "known": int(self.n["known"]),
               "success": self.rate("success", "known"),
               "cases_full": int(self.n["cases_full"]), "known_full": int(self.n["known_full"]),
               "success_full": self.rate("success_full", "known_full"),
               "prob_target_before": self.rate("p_before", "known"), "prob_target_after": self.rate("p_after", "known"),
               "prob_shift": self.rate("p_shift", "known"),
               "locality_n": int(self.n["loc"]), "locality_top1": self.rate("loc_same", "loc"),
               "locality_kl": self.rate("loc_kl", "loc"),
               "locality_known_n": int(self.n["loc_known"]), "locality_known": self.rate("loc_known_same", "loc_known"),
               "locality_shared_n": int(self.n["loc_shared"]), "locality_shared": self.rate("loc_shared_same", "loc_shared"),
               "locality_disjoint_n": int(self.n["loc_disjoint"]),
               "locality_disjoint": self.rate("loc_disjoint_same", "loc_disjoint"),
               "edits": int(self.n["edits"]),
               "reversible": self.rate("reversible", "edits"),
               "text_locality_top1": self.rate("text_same", "text"), "text_locality_kl": self.rate("text_kl", "text")}
        out["by_relation"] = {r: {"known": k, "success": s / k if k else None}
                              for r, (k, s) in sorted(self.by_relation.items())}
        out["by_length"] = {r: {"known": k, "success": s / k if k else None} for r, (k, s) in sorted(self.by_length.items())}
        return out


def _chosen(model, layers, embedding: bool) -> list[int]:
    """Table layers of a layer set; ``[]`` is allowed with ``embedding`` (the embedding alone)."""
    return [] if embedding and layers is not None and len(layers) == 0 else resolve_layers(model, layers)


def _pairs(countries: list[str], n: int, seed: int) -> list[tuple[str, str]]:
    """``n`` distinct unordered country pairs, seeded."""
    all_pairs = [(a, b) for i, a in enumerate(countries) for b in countries[i + 1:]]
    rng = random.Random(seed)
    rng.shuffle(all_pairs)
    return all_pairs[:n]


def _cases(probes: dict[str, list[Probe]], src: str, tgt: str) -> list[tuple[Probe, Probe]]:
    """(probe of src, same question of tgt) for every question both have."""
    other = {p.key: p for p in probes[tgt]}
    return [(p, other[p.key]) for p in probes[src] if p.key in other and p.answer_ids != other[p.key].answer_ids]


class EditEvaluator:
    """Holds the probes and the unedited model's scores; ``run`` evaluates one edit setting."""

    def __init__(self, model, tokenizer, facts: list[dict], cfg: EditEvalConfig, text: torch.Tensor | None = None):
        self.model, self.tok, self.cfg = model, tokenizer, cfg
        self.text = text  # optional (B, T) ids of unrelated text for text locality
        self.text_base = self._text_logits() if text is not None else None
        self.vocab = num_rows(model)
        self.probes = build_probes(facts, tokenizer, cfg.split, cfg.relations)
        if len(self.probes) < 2:
            raise ValueError(f"split {cfg.split!r} has facts of {len(self.probes)} countries; need at least 2")
        for label, layers in cfg.layer_sets.items():
            _chosen(model, layers, cfg.embedding)  # fail early on a bad layer set
        for s in cfg.strategies:
            check_strategy(s, cfg.align)
        try:  # the filler strategy needs it; other strategies run without one
            self.filler = resolve_filler(cfg.filler, tokenizer, self.vocab)
        except ValueError:
            if "filler" in cfg.strategies:
                raise
            self.filler = None
        self.entity = {c: entity_ids(tokenizer, c, self.vocab) for c in self.probes}
        holders = Counter(t for ids in self.entity.values() for t in set(ids))
        self.shared = frozenset(t for t, n in holders.items() if n > 1) if cfg.protect_shared else frozenset()
        flat = [p for ps in self.probes.values() for p in ps]
        base = score(model, [p.prompt_ids for p in flat], [p.answer_ids for p in flat])
        self.known = {(p.country, p.key): (bool(f), bool(g)) for p, f, g in zip(flat, base.first_ok, base.full_ok)}
        rng = random.Random(cfg.seed + 1)
        self.pool = rng.sample(flat, min(cfg.n_locality + 12, len(flat)))  # margin for excluded countries
        self.pool_base = self._score_pool()
        self.pairs = _pairs(sorted(self.probes), cfg.n_pairs, cfg.seed)

    @torch.no_grad()
    def _text_logits(self) -> torch.Tensor:
        return self.model(self.text.to(next(self.model.parameters()).device)).float().cpu()

    def _score_pool(self):
        return score(self.model, [p.prompt_ids for p in self.pool], [p.answer_ids for p in self.pool])

    def run(self, strategy: str, layers: list[int] | None, progress: bool = False, desc: str = "") -> dict:
        """Metrics of one (strategy, layer set) over all pairs."""
        tally = _Tally()
        directions = [(0, 1), (1, 0)] if self.cfg.mode == "swap" else [(0, 1)]
        for pair in tqdm(self.pairs, desc=desc or strategy, disable=not progress, leave=False):
            a_ids, b_ids = self.entity[pair[0]], self.entity[pair[1]]
            if strategy == "one_to_one" and len(a_ids) != len(b_ids):
                tally.add("skipped")
                continue
            cases = [c for s, t in directions for c in _cases(self.probes, pair[s], pair[t])]
            self._run_pair(pair, cases, strategy, layers, "equal" if len(a_ids) == len(b_ids) else "unequal", tally)
        return tally.summary()

    def measure(self, prompts, answers, apply, exclude: tuple[str, ...], tally: _Tally):
        """Score ``prompts + answers`` before and after ``apply()`` (an edit returning an undo
        record), undo it, and tally locality (facts of countries not in ``exclude``; also split into
        prompts that hold a token whose rows the edit wrote and prompts that hold none) and
        reversibility. Returns ``(before, after)`` scores."""
        before = score(self.model, prompts, answers)
        record = apply()
        edited = {t for ids, _ in record.old.values() for t in ids.tolist()}
        try:
            after, pool_after = score(self.model, prompts, answers), self._score_pool()
            if self.text is not None:
                text_after = self._text_logits()  # (B, T, V)
                v = text_after.shape[-1]
                same_text = text_after.argmax(-1) == self.text_base.argmax(-1)
                tally.add("text", same_text.numel())
                tally.add("text_same", float(same_text.sum()))
                tally.add("text_kl", float(kl_divergence(self.text_base.view(-1, v), text_after.view(-1, v))
                                          .clamp_min(0).sum()))
        finally:
            record.undo()
        restored, pool_restored = score(self.model, prompts, answers), self._score_pool()
        tally.add("edits")
        tally.add("reversible", float(torch.equal(restored.last_logits, before.last_logits)
                                      and torch.equal(pool_restored.last_logits, self.pool_base.last_logits)))
        keep = [i for i, p in enumerate(self.pool) if p.country not in exclude][:self.cfg.n_locality]
        same = pool_after.last_logits[keep].argmax(-1) == self.pool_base.last_logits[keep].argmax(-1)
        tally.add("loc", len(keep))
        tally.add("loc_same", float(same.sum()))
        # a prompt without an edited token reads no edited row
        holds = torch.tensor([bool(edited & set(self.pool[i].prompt_ids)) for i in keep], dtype=torch.bool)
        for name, part in (("loc_shared", holds), ("loc_disjoint", ~holds)):
            tally.add(name, float(part.sum()))
            tally.add(name + "_same", float(same[part].sum()))
        known = [i for i in keep if self.pool_base.first_ok[i]]  # other countries' facts the model answers right
        tally.add("loc_known", len(known))
        tally.add("loc_known_same", float(pool_after.first_ok[known].sum()) if known else 0.0)
        kl = kl_divergence(self.pool_base.last_logits[keep], pool_after.last_logits[keep]).clamp_min(0)
        tally.add("loc_kl", float(kl.sum()))
        return before, after

    def _run_pair(self, pair, cases, strategy, layers, length_class, tally: _Tally) -> None:
        prompts = [src.prompt_ids for src, _ in cases]
        answers = [tgt.answer_ids for _, tgt in cases]
        apply = lambda: edit(self.model, self.entity[pair[0]], self.entity[pair[1]], strategy=strategy,  # noqa: E731
                             layers=layers, mode=self.cfg.mode, align=self.cfg.align, filler=self.filler,
                             embedding=self.cfg.embedding, keep=self.shared)
        before, after = self.measure(prompts, answers, apply, pair, tally)
        tally.add("pairs")
        p_before, p_after = before.probs(), after.probs()
        for i, (src, tgt) in enumerate(cases):
            knows = self.known[(src.country, src.key)], self.known[(tgt.country, tgt.key)]
            if src.answer_ids[0] != tgt.answer_ids[0]:
                tally.add("cases")
                if knows[0][0] and knows[1][0]:
                    tally.add_success(tgt.answer_ids[0], bool(after.first_ok[i]), p_before[i], p_after[i],
                                      (src.relation, length_class))
            tally.add("cases_full")
            if knows[0][1] and knows[1][1]:
                tally.add("known_full")
                tally.add("success_full", bool(after.full_ok[i]))


def run_edit_eval(model, tokenizer, facts: list[dict], cfg: EditEvalConfig, progress: bool = True) -> dict:
    """Every (strategy, layer set) of ``cfg``; returns a JSON-ready dict."""
    ev = EditEvaluator(model, tokenizer, facts, cfg)
    runs = []
    for label, layers in cfg.layer_sets.items():
        chosen = _chosen(model, layers, cfg.embedding)
        for strategy in cfg.strategies:
            res = ev.run(strategy, chosen, progress, desc=f"{strategy}/{label}")
            runs.append({"strategy": strategy, "align": cfg.align, "layers_label": label, "layers": chosen, **res})
    known_facts = sum(f for f, _ in ev.known.values())
    return {"config": {**asdict(cfg), "strategies": list(cfg.strategies)},
            "model": model.cfg.to_dict(), "table_layers": resolve_layers(model),
            "base": {"probes": len(ev.known), "known_first": known_facts,
                     "known_full": sum(g for _, g in ev.known.values()),
                     "countries": len(ev.probes),
                     "multi_token_countries": sum(len(v) > 1 for v in ev.entity.values())},
            "runs": runs}
