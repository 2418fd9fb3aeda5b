"""Fact prompts as token ids: the probes of the edit evaluation.

A probe is one fact row of ``facts/facts.jsonl`` whose prompt names the country and whose
answer is the object ("The capital of Spain is" -> " Madrid"). Facts whose answer is the
country itself ("The city of Madrid is the capital of" -> " Spain") do not mention the edited
entity in the prompt and are left out.

Answer ids are the tokens that ``prompt + answer`` adds after the prompt's own tokens, i.e.
exactly what the model sees in training text.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from ..data.codec import TextCodec
from .tokens import encode_prompt


@dataclass(frozen=True)
class Probe:
    """One fact prompt and its answer, tokenized (prompt ids start with EOS)."""

    country: str
    relation: str
    template_id: int
    prompt: str
    answer: str
    prompt_ids: tuple[int, ...]
    answer_ids: tuple[int, ...]

    @property
    def key(self) -> tuple[str, int]:
        """(relation, template) — the same question asked of another country."""
        return self.relation, self.template_id


def answer_ids(tokenizer, prompt: str, answer: str) -> list[int]:
    """Tokens of ``answer`` as they follow ``prompt`` in running text."""
    codec = TextCodec.of(tokenizer)
    head, full = codec.encode(prompt), codec.encode(prompt + answer)
    if full[:len(head)] == head and len(full) > len(head):
        return full[len(head):]
    return codec.encode(answer)


def make_probe(tokenizer, country: str, relation: str, template_id: int, prompt: str, answer: str) -> Probe:
    """Tokenize one probe."""
    return Probe(country, relation, int(template_id), prompt, answer, tuple(encode_prompt(tokenizer, prompt)),
                 tuple(answer_ids(tokenizer, prompt, answer)))


def build_probes(facts: list[dict], tokenizer, split: str | None = None,
                 relations: tuple[str, ...] | None = None) -> dict[str, list[Probe]]:
    """Probes per country: facts of ``split`` (all if None) whose prompt mentions the country."""
    out: dict[str, list[Probe]] = defaultdict(list)
    for f in facts:
        if split is not None and f["split"] != split:
            continue
        if relations is not None and f["relation"] not in relations:
            continue
        if f.get("answer_is", "object") != "object" or f["country"] not in f["prompt"]:
            continue
        out[f["country"]].append(make_probe(tokenizer, f["country"], f["relation"], f["template_id"],
                                            f["prompt"], f["answer"]))
    return dict(out)
