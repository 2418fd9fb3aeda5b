"""Batched generation: prompts of different lengths decoded together, each as it would be alone.

Prompts are left-padded to the longest one; every row gets its own positions (``0..len-1`` on its
real tokens) and a mask that hides the padding, so a row computes what it would alone::

    slots       0  1  2  3  4 | 5 ...       (cache slots, shared by the batch)
    row a      p  p a0 a1 a2 | x           positions 0 0 0 1 2 | 3   (p = padding, masked)
    row b      b0 b1 b2 b3 b4 | y           positions 0 1 2 3 4 | 5

Each request carries its ``SamplingParams`` (temperature, top-k, top-p, seed, budget) and samples
from its own row with its own seeded generator, so its tokens do not depend on the rest of the
batch. A row that produced ``eos_id``, used up its budget or met its ``stop`` test leaves the batch
and the KV cache (``KVCache.keep_rows``).

Table rows are fetched once per step for the whole batch: a lookup deduplicates the ids of every
row, and the model's tables are asked to prefetch the next step's ids right after sampling,
before the step is yielded, so the gather overlaps with the caller's work and the next forward's
attention. ``decode_batch`` yields one ``BatchStep`` per forward pass with the number of distinct
ids it looked up and the sum of each request's own distinct ids (what one-at-a-time decoding would
fetch).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from .generate import _generator, check_sampling, decode_one_token, draw, prefill, sampling_probs
from .kv_cache import KVCache
from ..model.tables import check_ids


@dataclass(frozen=True)
class SamplingParams:
    """How one request is decoded: greedy when ``temperature == 0``; ``seed`` fixes its sampled tokens."""

    max_new_tokens: int = 32
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None

    def __post_init__(self):
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        check_sampling(self.temperature, self.top_k, self.top_p)


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


def _distinct(ids: torch.Tensor, real: torch.Tensor) -> tuple[int, int]:
    """Distinct ids of the whole batch ``ids (B, T)`` and the sum of each row's own (``real (B, T)``: not padding)."""
    return torch.unique(ids).numel(), sum(torch.unique(r[k]).numel() for r, k in zip(ids, real))


def _params_list(params, n: int) -> list[SamplingParams]:
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} SamplingParams for {n} prompts")
    return params


def padding_mask(real: torch.Tensor, start_pos: int, q_len: int) -> torch.Tensor:
    """Attention mask ``(B, 1, T, S)`` for queries at slots ``start_pos..start_pos+T-1`` over keys
    ``real (B, S)`` (False = padding): causal, padding hidden, a padding slot sees only itself (so
    no row is empty)."""
    keys = torch.arange(real.shape[1], device=real.device)
    queries = torch.arange(start_pos, start_pos + q_len, device=real.device)
    causal = keys[None, :] <= queries[:, None]  # (T, S)
    own = keys[None, :] == queries[:, None]  # (T, S)
    return (causal & (real[:, None, :] | own))[:, None]  # (B, 1, T, S)


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int, device=None):
    """Left-padded ``ids (B, W)``, the padding per row ``(B,)``, ``positions (B, W)`` and the prefill
    mask ``(B, 1, W, W)`` (``padding_mask``)."""
    width = max(len(p) for p in prompts)
    pad = torch.tensor([width - len(p) for p in prompts], device=device)  # (B,)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, width - len(p):] = torch.tensor(list(p), dtype=torch.long)
    slots = torch.arange(width, device=device)
    positions = (slots[None, :] - pad[:, None]).clamp(min=0)  # (B, W)
    return ids.to(device), pad, positions, padding_mask(slots[None, :] >= pad[:, None], 0, width)


def decode_batch(model, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams],
                 eos_id: int | None = None, stop: Callable[[int, list[int]], bool] | None = None,
                 pad_id: int | None = None, store="auto") -> Iterator[BatchStep]:
    """Yield a ``BatchStep`` per forward pass over ``prompts`` (token id lists, any lengths >= 1).

    ``params`` is one ``SamplingParams`` for all or one per prompt. A request ends after its
    ``max_new_tokens``, at ``eos_id`` (included in its tokens), when ``stop(i, tokens_so_far)`` is
    true, or at the model's ``max_seq_len``. ``pad_id`` (default ``eos_id`` or 0) fills the left
    padding; it never affects results. ``store="auto"`` prefetches through the model's tables (``model.tables``);
    ``None`` disables prefetch. Arguments are checked before the first step is asked for.
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
    return _decode_batch(model, [list(p) for p in prompts], params, eos_id, stop, pad_id, store)


@torch.no_grad()
def _decode_batch(model, prompts, params, eos_id, stop, pad_id, store) -> Iterator[BatchStep]:
    cfg = model.cfg
    param = next(model.parameters())
    device = param.device
    budget = {i: min(sp.max_new_tokens, cfg.max_seq_len - len(p) + 1) for i, (p, sp) in enumerate(zip(prompts, params))}
    active = [i for i in range(len(prompts)) if budget[i] > 0]  # requests in the batch, in cache order
    if not active:
        return
    store = model.tables if store == "auto" else store
    ids, pad, positions, mask = left_pad([prompts[i] for i in active], pad_id, device)
    width = ids.shape[1]
    generators = {i: _generator(params[i].seed, device) for i in active}
    new: dict[int, list[int]] = {i: [] for i in active}
    cache = KVCache(cfg, len(active), max_len=width + max(budget[i] for i in active) - 1, device=device,
                    dtype=param.dtype)
    rows, request_rows = _distinct(ids, mask[:, 0, -1])
    logits = prefill(model, ids, cache, store, positions=positions, attn_mask=mask)
    for step in range(max(budget.values())):
        tokens = sample_rows(logits, [params[i] for i in active], [generators[i] for i in active])
        keep, finished = [], []
        for j, (i, tok) in enumerate(zip(active, tokens)):
            new[i].append(tok)
            done = tok == eos_id or len(new[i]) >= budget[i] or (stop is not None and stop(i, new[i]))
            (finished if done else keep).append(j)
        token = torch.tensor([tokens[j] for j in keep], dtype=torch.long, device=device)[:, None]  # (b, 1)
        if keep and store is not None:
            store.prefetch(token)  # the next step's rows, gathered while this step is handed out
        yield BatchStep(list(active), tokens, [active[j] for j in finished], rows, request_rows)
        if not keep:
            return
        if finished:
            kept = torch.tensor(keep, device=device)
            cache.keep_rows(kept)
            pad, active = pad[kept], [active[j] for j in keep]
        slot = width + step
        rows, request_rows = token.unique().numel(), len(keep)
        step_mask = padding_mask(torch.arange(slot + 1, device=device)[None, :] >= pad[:, None], slot, 1)  # (b, 1, 1, S)
        logits = decode_one_token(model, token, slot, cache, positions=(slot - pad)[:, None], attn_mask=step_mask)


def sample_rows(logits: torch.Tensor, params: list[SamplingParams], generators: list) -> list[int]:
    """One token per row of ``logits (B, V)``, each row with its own settings and generator: the token
    ``sample`` gives that row alone. Rows with the same settings get their probabilities in one call;
    each row then draws from its own generator."""
    if all(sp.temperature == 0 for sp in params):
        return logits.argmax(-1).tolist()
    out = [0] * len(params)
    groups: dict[tuple, list[int]] = {}
    for j, sp in enumerate(params):
        groups.setdefault((sp.temperature, sp.top_k, sp.top_p), []).append(j)
    for (temperature, top_k, top_p), rows in groups.items():
        if temperature == 0:
            for j, tok in zip(rows, logits[rows].argmax(-1).tolist()):
                out[j] = tok
            continue
        probs = sampling_probs(logits[rows], temperature, top_k, top_p)  # (n, V)
        for j, tok in zip(rows, draw(probs, [generators[j] for j in rows]).tolist()):
            out[j] = tok
    return out


def generate_batch(model, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams],
                   eos_id: int | None = None, **kwargs) -> list[list[int]]:
    """The new tokens of every prompt (collects ``decode_batch``; same arguments)."""
    out: list[list[int]] = [[] for _ in prompts]
    for step in decode_batch(model, prompts, params, eos_id, **kwargs):
        for i, tok in zip(step.requests, step.tokens):
            out[i].append(tok)
    return out
