"""Batched generation: prompts of different lengths decoded together, each as it would be alone.

``decode_batch`` runs every prompt through the one decode core (``core.DecodeCore``): the prompts
are prefilled as one right-padded group, each into its own row of the KV cache (slot = position,
padding hidden by the mask), and then decoded one step at a time, every row at its own position::

    slots       0  1  2  3  4  5 ...
    row a      a0 a1 a2  x .. ..        a's next token goes to slot 3 (position 3)
    row b      b0 b1 b2 b3 b4  y        b's to slot 5

Each request carries its ``SamplingParams`` (temperature, top-k, top-p, seed, budget) and samples
from its own row with its own seeded generator, so its tokens do not depend on the rest of the
batch. A row that produced ``eos_id``, used up its budget or met its ``stop`` test leaves the batch
and the KV cache.

Table rows are fetched once per step for the whole batch: a lookup deduplicates the ids of every
row, and the model's tables are asked to prefetch the next step's ids right after sampling, before
the step is yielded, so the gather overlaps with the caller's work and the next forward's
attention. ``decode_batch`` yields one ``BatchStep`` per forward pass with the number of distinct
ids it looked up and the sum of each request's own distinct ids (what one-at-a-time decoding would
fetch).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from .core import DecodeCore, Generation
from .sampling import SamplingParams, sample_rows  # noqa: F401  (re-exported)
from ..model.tables import check_ids


@dataclass
class BatchStep:
    """One forward pass of the batch and the tokens sampled from it.

    ``requests[j]`` produced ``tokens[j]``; ``finished`` lists the requests that left after this
    step. ``rows`` is the number of distinct token ids the forward looked up (per table layer);
    ``request_rows`` is the sum over its requests of their own distinct ids.
    """

    requests: list[int]
    tokens: list[int]
    finished: list[int]
    rows: int
    request_rows: int


def _params_list(params, n: int) -> list[SamplingParams]:
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} SamplingParams for {n} prompts")
    return params


def decode_batch(model, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams],
                 eos_id: int | None = None, stop: Callable[[int, list[int]], bool] | None = None,
                 pad_id: int | None = None, store="auto", graphs: str = "auto") -> Iterator[BatchStep]:
    """Yield a ``BatchStep`` per forward pass over ``prompts`` (token id lists, any lengths >= 1).

    ``params`` is one ``SamplingParams`` for all or one per prompt. A request ends after its
    ``max_new_tokens``, at ``eos_id`` (included in its tokens), when ``stop(i, tokens_so_far)`` is
    true, or at the model's ``max_seq_len``. ``pad_id`` (default ``eos_id`` or 0) fills the
    padding; it never affects results. ``store="auto"`` prefetches through the model's tables
    (``model.tables``); ``None`` disables prefetch. ``graphs`` picks the decode step
    (``core.DecodeCore``). Arguments are checked before the first step is asked for.
    """
    params = _params_list(params, len(prompts))
    cfg = model.cfg
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty")
        if len(p) > cfg.max_seq_len:
            raise ValueError(f"prompt {i} of {len(p)} tokens exceeds max_seq_len={cfg.max_seq_len}")
        check_ids(torch.tensor(list(p)), cfg.vocab_size)
    pad_id = pad_id if pad_id is not None else (eos_id if eos_id is not None else 0)
    seqs = [Generation(list(p), sp, None if stop is None else (lambda toks, i=i: stop(i, toks)))
            for i, (p, sp) in enumerate(zip(prompts, params))]
    longest = max((len(p) + min(sp.max_new_tokens, cfg.max_seq_len - len(p) + 1) for p, sp in zip(prompts, params)),
                  default=1)
    core = DecodeCore(model, () if eos_id is None else (eos_id,), pad_id, store, max_rows=max(1, len(prompts)),
                      max_len=max(1, longest - 1), graphs=graphs)
    return _decode_batch(core, seqs)


@torch.no_grad()
def _decode_batch(core: DecodeCore, seqs: list[Generation]) -> Iterator[BatchStep]:
    if not seqs:
        return
    index = {id(s): i for i, s in enumerate(seqs)}
    progress = core.add(seqs)
    while progress.emitted:
        yield BatchStep([index[id(s)] for s in progress.emitted], [s.tokens[-1] for s in progress.emitted],
                        [index[id(s)] for s in progress.emitted if s.finish_reason is not None],
                        *_distinct(progress))
        progress = core.step()


def _distinct(progress) -> tuple[int, int]:
    """Distinct ids of the forward and the sum of each row's own distinct ids."""
    if progress.ids is None:  # a decode step: one id per row
        return len(set(s.tokens[-2] for s in progress.emitted)), len(progress.emitted)
    return (torch.unique(progress.fed).numel(),
            sum(torch.unique(r[:n]).numel() for r, n in zip(progress.ids, progress.lengths)))


def generate_batch(model, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams],
                   eos_id: int | None = None, **kwargs) -> list[list[int]]:
    """The new tokens of every prompt (collects ``decode_batch``; same arguments)."""
    out: list[list[int]] = [[] for _ in prompts]
    for step in decode_batch(model, prompts, params, eos_id, **kwargs):
        for i, tok in zip(step.requests, step.tokens):
            out[i].append(tok)
    return out
