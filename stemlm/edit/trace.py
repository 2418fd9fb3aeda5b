"""Where a real model keeps a fact: activation patching at the subject's tokens.

A row edit swaps what a STEM layer computes at the positions of a token; in a model converted from a
dense one, the best its rows can do is reproduce the dense layer there. So, on the *dense* model, run
"The capital of Germany is" (the *other* prompt), keep its activations at the subject's positions, and
put them into "The capital of Spain is" (the *subject* prompt) at a set of layers:

* ``up``    — the up-projection ``W_u x``: what swapping STEM rows that equal the dense up-projection
  exactly (at this very context) would do; the ceiling of a row edit of a converted model at those layers;
* ``ffn``   — the whole FFN output: what a token-indexed table of complete FFN outputs could do;
* ``resid`` — the residual stream entering a layer (classic causal tracing): patched at layer 0 it is
  the input embedding, i.e. renaming the token — a positive control, not an edit.

A case *flips* when the patched run's top-1 next token is the first token of the other country's answer.
Cases are pairs of fact prompts of the same template and token length that the dense model answers
right, whose answers start with different tokens; the subject span is where the two prompts differ.
"""

from __future__ import annotations

import contextlib
import random
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from .probes import Probe
from .scoring import score

KINDS = ("up", "ffn", "resid")


@dataclass(frozen=True)
class Case:
    """The subject prompt (A), the other prompt (B: same template and length) and the span ``[lo, hi)``
    of positions where they differ (the country's tokens)."""

    subject: Probe
    other: Probe
    span: tuple[int, int]


def subject_span(a: Sequence[int], b: Sequence[int]) -> tuple[int, int] | None:
    """``[lo, hi)``: from the first differing position to the end of the last; None if the prompts
    differ in length or not at all."""
    if len(a) != len(b) or list(a) == list(b):
        return None
    diff = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
    return diff[0], diff[-1] + 1


def known_cases(model, probes: dict[str, list[Probe]], n: int, seed: int = 0) -> list[Case]:
    """Up to ``n`` seeded cases over the countries of ``probes`` (both prompts answered right by the
    model, top-1 first token; answers starting with different tokens; equal prompt lengths)."""
    flat = [q for qs in probes.values() for q in qs]
    ok = score(model, [q.prompt_ids for q in flat], [q.answer_ids for q in flat]).first_ok
    by_key = defaultdict(list)
    for q, right in zip(flat, ok.tolist()):
        if right:
            by_key[q.key].append(q)
    cases = []
    for qs in by_key.values():
        for a in qs:
            for b in qs:
                span = subject_span(a.prompt_ids, b.prompt_ids)
                if a.country != b.country and span and a.answer_ids[0] != b.answer_ids[0]:
                    cases.append(Case(a, b, span))
    cases.sort(key=lambda c: (c.subject.country, c.other.country, c.subject.key))
    random.Random(seed).shuffle(cases)
    return cases[:n]


def _site(model, kind: str, layer: int) -> torch.nn.Module:
    block = model.layers[layer]
    if kind == "up":
        if not hasattr(block.ffn, "w_up"):
            raise ValueError(f"layer {layer} ({block.kind}) has no up-projection to patch")
        return block.ffn.w_up
    return block.ffn if kind == "ffn" else block


@contextlib.contextmanager
def _hooks(model, kind: str, layers: Iterable[int], fn):
    """``fn(layer, tensor) -> tensor | None`` on the site's output (``up``, ``ffn``) or input (``resid``);
    None leaves the tensor as it is."""
    def pre(layer, args):
        new = fn(layer, args[0])
        return None if new is None else (new, *args[1:])

    handles = []
    for layer in layers:
        site = _site(model, kind, layer)
        if kind == "resid":
            handles.append(site.register_forward_pre_hook(lambda m, args, layer=layer: pre(layer, args)))
        else:
            handles.append(site.register_forward_hook(lambda m, args, out, layer=layer: fn(layer, out)))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _groups(cases: list[Case]) -> dict[int, list[int]]:
    """Case indices by prompt length (one pad-free batch each)."""
    out = defaultdict(list)
    for i, c in enumerate(cases):
        out[len(c.subject.prompt_ids)].append(i)
    return out


def _next_probs(model, ids: torch.Tensor) -> torch.Tensor:
    """Next-token distribution after the last position ``(b, V)`` (the head applied there only)."""
    h = model(ids, return_hidden=True)[:, -1]  # (b, d)
    return torch.softmax(model.lm_head(h).float(), -1)


@torch.no_grad()
def patch_effects(model, cases: list[Case], kind: str, layer_sets: dict[str, list[int]]) -> dict[str, dict]:
    """Per layer set: the other prompt's ``kind`` activations at the subject span, patched into the
    subject prompt at every layer of the set. ``{label: {flip, p_other, p_other_before, keeps, cases}}``:
    flip = fraction whose top-1 becomes the other answer's first token; p_other = its mean probability
    after the patch (before: unpatched); keeps = fraction still answering the subject's own answer."""
    if kind not in KINDS:
        raise ValueError(f"unknown patch kind {kind!r}; choose one of {', '.join(KINDS)}")
    if not cases:
        return {label: {"flip": None, "p_other": None, "p_other_before": None, "keeps": None, "cases": 0}
                for label in layer_sets}
    every = sorted({i for s in layer_sets.values() for i in s})
    n = len(cases)
    other_tok = torch.tensor([c.other.answer_ids[0] for c in cases])
    own_tok = torch.tensor([c.subject.answer_ids[0] for c in cases])
    before = torch.zeros(n)
    after = {label: torch.zeros(n, model.cfg.vocab_size) for label in layer_sets}
    for length, idx in _groups(cases).items():
        subj = torch.tensor([cases[i].subject.prompt_ids for i in idx])  # (b, T)
        other = torch.tensor([cases[i].other.prompt_ids for i in idx])  # (b, T)
        span = torch.zeros(len(idx), length, 1, dtype=torch.bool)  # (b, T, 1): the subject's positions
        for row, i in enumerate(idx):
            lo, hi = cases[i].span
            span[row, lo:hi] = True
        saved = {}
        with _hooks(model, kind, every, lambda layer, t: saved.__setitem__(layer, t.clone())):
            model(other)
        before[idx] = _next_probs(model, subj)[torch.arange(len(idx)), other_tok[idx]]
        for label, layers in layer_sets.items():
            with _hooks(model, kind, layers, lambda layer, t: torch.where(span, saved[layer], t)):
                after[label][idx] = _next_probs(model, subj)
    out = {}
    for label, probs in after.items():
        top = probs.argmax(-1)
        out[label] = {"flip": float((top == other_tok).float().mean()),
                      "p_other": float(probs[torch.arange(n), other_tok].mean()),
                      "p_other_before": float(before.mean()),
                      "keeps": float((top == own_tok).float().mean()), "cases": n}
    return out
