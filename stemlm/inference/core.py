"""The one batched decode core: a running batch of sequences that join, decode and leave.

``generate`` (one prompt or equal-length prompts), ``decode_batch`` (``generate_batch``, the
evaluation's ``generate_until``) and the server's engine all drive a ``DecodeCore``:

* ``add(seqs)`` prefills a group of prompts as one forward into free rows of the KV cache
  (``SlotCache``: row ``r`` holds its keys at slots ``0..len-1``, so nothing is shifted or merged
  when rows join; prompts of unequal length packed several to a row, ``pack_prompts``) and samples
  each one's first token;
* ``step()`` runs one forward over every running row (each at its own position) and samples the
  next token of each; ``step(join=seqs)`` prefills newcomers in that same forward (a prefill merged
  into the step: one forward where ``add`` and ``step`` take two, for the server's engine);
* a sequence ends at one of ``eos_ids`` (kept in its tokens), when its ``stop(tokens)`` test is
  true, after ``params.max_new_tokens`` or at the model's ``max_seq_len``; it then leaves the batch
  (the rows after it move up, keeping their order), as does one that is ``drop``ped;
* right after sampling, the model's tables are asked to prefetch the rows of the next step's ids,
  so the gather overlaps with the caller's work (handing tokens out, scheduling) and the next
  forward's attention; the ticket the store returns is handed to that forward (``table_rows``).

Each sequence samples from its own row with its own seeded generator (``sampling.sample_rows``),
so its tokens are those it gets decoded alone. The decode forward runs eagerly (shapes follow the
batch) or through ``static.StaticStep`` (fixed row buckets and the full cache length, optionally
captured as CUDA graphs): ``graphs`` is ``auto`` (graphs on CUDA, eager elsewhere), ``on``, ``off`` or
``static`` (the static shapes without capture: what a graph replays, runnable on CPU).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence as Seq
from dataclasses import dataclass, field

import torch

from ..ffn.ngram import context_reach
from .kv_cache import SlotCache, ragged_mask
from ..model.decoder import attention_mask, padding_mask
from .sampling import SamplingParams, new_generator, sample_rows, token_logprobs
from .static import StaticStep, resolve_graphs


@dataclass(eq=False)
class Generation:
    """One prompt being decoded. ``stop(tokens)`` ends it early; ``logprobs``/``prompt_logprobs`` ask for
    that many alternatives per generated / prompt token (0 = only the chosen token's). ``generator``
    defaults to one seeded with ``params.seed``; sequences may share one (drawn in row order).

    The core fills ``tokens``, ``token_logprobs`` (``(logprob, top)`` per token when asked),
    ``prompt_entries`` (the same per prompt token, ``(None, None)`` first) and ``finish_reason``
    (``stop``, ``length``, or what ``drop`` was given)."""

    prompt: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    stop: Callable[[list[int]], bool] | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    generator: torch.Generator | None = None
    tokens: list[int] = field(default_factory=list)
    token_logprobs: list = field(default_factory=list)
    prompt_entries: list | None = None
    finish_reason: str | None = None
    budget: int = 0  # tokens it may produce: max_new_tokens, cut to the context

    @property
    def next_slot(self) -> int:
        """The cache slot (= position) of the token it feeds next: its last sampled one."""
        return len(self.prompt) + len(self.tokens) - 1


def pack_prompts(lengths: Seq[int], width: int) -> list[list[int]]:
    """Prompt indices packed into rows of ``width`` tokens, first fit in decreasing length (each row's
    prompts in that order); a prompt as long as ``width`` has a row to itself."""
    bins: list[list[int]] = []
    room: list[int] = []
    for j in sorted(range(len(lengths)), key=lambda j: -lengths[j]):
        b = next((b for b, r in enumerate(room) if lengths[j] <= r), None)
        if b is None:
            bins.append([j])
            room.append(width - lengths[j])
        else:
            bins[b].append(j)
            room[b] -= lengths[j]
    return bins


def last_tokens(seq: Generation, n: int) -> list[int]:
    """The last ``n`` tokens of ``seq``'s prompt and generated tokens (fewer at its start), from their tails:
    no copy of the whole sequence."""
    if len(seq.tokens) >= n:
        return seq.tokens[-n:]
    return seq.prompt[max(0, len(seq.prompt) - (n - len(seq.tokens))):] + seq.tokens


@dataclass
class Progress:
    """What one ``add`` or ``step`` did: ``emitted`` got one new token each (in row order), ``finished``
    ended in this call; a prefill's prompts, right-padded, are ``ids (n, W)`` with ``lengths[j]`` real
    tokens in row ``j``, and ``fed`` the ids its forward ran (the prompts packed, ``pack_prompts``)."""

    emitted: list[Generation]
    finished: list[Generation]
    ids: torch.Tensor | None = None
    lengths: list[int] = field(default_factory=list)
    fed: torch.Tensor | None = None


class DecodeCore:
    """A running batch over ``model`` of at most ``max_rows`` sequences of at most ``max_len`` tokens.

    ``store="auto"`` prefetches through the model's tables (``model.tables``); ``None`` disables
    prefetch. ``pad_id`` fills the right padding of a prefill group (it never affects results).
    """

    def __init__(self, model, eos_ids: Seq[int] = (), pad_id: int = 0, store="auto", max_rows: int = 16,
                 max_len: int | None = None, graphs: str = "auto"):
        if max_rows < 1:
            raise ValueError(f"max_rows must be >= 1, got {max_rows}")
        cfg = model.cfg
        param = next(model.parameters())
        self.model, self.device, self.pad_id = model, param.device, pad_id
        self.eos_ids = frozenset(eos_ids)
        self.store = model.tables if store == "auto" else store
        # rows in the model's memory need no fetching
        self._prefetch = self.store is not None and self.store.tier != "device"
        self.reach = context_reach(cfg) if cfg.ngram_layers else 0  # tokens before the fed one its keys hash
        self.max_len = min(max_len or cfg.max_seq_len, cfg.max_seq_len)
        self.mode = resolve_graphs(graphs, self.device, cfg)
        self.static = None
        if self.mode == "eager":
            self.max_rows = max_rows
            self.cache = SlotCache(cfg, max_rows, min(self.max_len, 64), self.device, param.dtype)
        else:
            self.static = StaticStep(model, max_rows, self.max_len, self.store, graphs=self.mode == "graphs")
            self.max_rows, self.cache = self.static.rows, self.static.cache
            if self.static.views:  # the step reads host rows in place: nothing to prefetch
                self._prefetch = False
        self.running: list[Generation] = []
        self._ticket = None  # the rows prefetched for the next step's ids (store.prefetch), or None

    # -- joining ------------------------------------------------------------------------------
    @torch.no_grad()
    def add(self, seqs: Seq[Generation]) -> Progress:
        """Prefill ``seqs`` as one group and sample each one's first token; a sequence with no room
        for a token finishes at once (``length``) unless it asked for prompt logprobs."""
        fresh, done = self._prepare(seqs)
        if not fresh:
            return Progress([], done)
        first = len(self.running)
        self.running += fresh
        ids, fed, lengths, logits = self._prefill(fresh, list(range(first, len(self.running))))
        emitted = self._first_tokens(fresh, logits)
        return Progress(emitted, done + self._retire(), ids, lengths, fed)

    def _prepare(self, seqs: Seq[Generation]) -> tuple[list[Generation], list[Generation]]:
        """``(to prefill, finished at once)``: each sequence's budget and generator set, room and length checked."""
        fresh, done = [], []
        for s in seqs:
            s.budget = min(s.params.max_new_tokens, self.model.cfg.max_seq_len - len(s.prompt) + 1)
            if s.generator is None:
                s.generator = new_generator(s.params.seed, self.device)
            if s.budget <= 0 and s.prompt_logprobs is None:
                s.finish_reason = "length"
                done.append(s)
            else:
                fresh.append(s)
        if len(self.running) + len(fresh) > self.max_rows:
            raise ValueError(f"{len(fresh)} new sequences do not fit: {len(self.running)} of {self.max_rows} rows "
                             "are taken")
        longest = max((len(s.prompt) for s in fresh), default=0)
        if longest > self.max_len:
            raise ValueError(f"a prompt of {longest} tokens exceeds this core's max_len={self.max_len}")
        return fresh, done

    def _first_tokens(self, fresh: list[Generation], logits: torch.Tensor) -> list[Generation]:
        """Sample the first token of every prefilled sequence with budget left (``logits (n, V)``, one row each);
        those without budget (asked only for prompt logprobs) finish (``length``)."""
        going = [j for j, s in enumerate(fresh) if s.budget > 0]
        for s in fresh:
            if s.budget <= 0:
                s.finish_reason = "length"
        return self._sample([fresh[j] for j in going], logits[going])

    def _prefill(self, group: list[Generation], cache_rows: list[int]) -> tuple[torch.Tensor, torch.Tensor, list[int],
                                                                                torch.Tensor]:
        """Run the group's prompts into ``cache_rows``; ``(ids (n, W) right-padded, the ids fed, lengths,
        last logits (n, V))``.

        Prompts of unequal length are packed several to a row of the longest one's width where they fit
        (``pack_prompts``), each attending only to itself (``doc_ids``) at its own positions: a group of
        lengths 8..64 computes about half the tokens it would right-padded (a model with n-gram keys,
        which would hash across packed neighbours, stays right-padded)."""
        lengths = [len(s.prompt) for s in group]
        width = max(lengths)
        self._reserve(cache_rows[-1] + 1, width + 1)
        padded = self._padded(group, width)
        bins = pack_prompts(lengths, width) if not self.reach else None
        if bins is not None and len(bins) < len(group):
            ids, hidden, ends = self._packed_forward(padded, cache_rows, lengths, bins)
        else:
            ids = padded.to(self.device)
            rows = self._fetch(ids)
            mask = None
            if min(lengths) != width:  # causal, the padding keys hidden
                real = torch.arange(width, device=self.device)[None, :] < torch.tensor(lengths, device=self.device)[:, None]
                mask = padding_mask(real, 0, width)  # (n, 1, W, W)
            hidden = self.model(ids, start_pos=0, cache=self.cache.prefill(cache_rows), attn_mask=mask,
                                return_hidden=True, table_rows=rows)
            ends = [(j, 0) for j in range(len(group))]  # where each prompt starts: (row of hidden, offset)
        at = torch.tensor([[b, off + n - 1] for (b, off), n in zip(ends, lengths)], device=self.device)  # (n, 2)
        last = hidden[at[:, 0], at[:, 1]]  # (n, d): each prompt's last token
        self._prompt_logprobs(group, lambda j: hidden[ends[j][0], ends[j][1]:ends[j][1] + lengths[j] - 1])
        return padded, ids, lengths, self.model.lm_head(last)  # (n, V)

    def _fetch(self, ids: torch.Tensor):
        """The ticket of the rows of ``ids`` a prefill forward looks up (``model.prefetch_rows``), or None when
        the tables are in the model's memory."""
        return self.model.prefetch_rows(ids, tables=self.store) if self._prefetch else None

    def _padded(self, group: list[Generation], width: int) -> torch.Tensor:
        """The group's prompts right-padded to ``width`` (host, ``(n, width)``)."""
        padded = torch.full((len(group), width), self.pad_id, dtype=torch.long)
        for j, s in enumerate(group):
            padded[j, :len(s.prompt)] = torch.tensor(s.prompt, dtype=torch.long)
        return padded

    def _prompt_logprobs(self, group: list[Generation], states: Callable[[int], torch.Tensor]) -> None:
        """Fill ``prompt_entries`` of the sequences that ask, from ``states(j)``: the hidden states ``(len - 1, d)``
        of prompt ``j``'s tokens but the last."""
        for j, s in enumerate(group):
            if s.prompt_logprobs is not None:
                scored = self.model.lm_head(states(j))  # (len - 1, V)
                s.prompt_entries = [(None, None)] + token_logprobs(scored, s.prompt[1:], s.prompt_logprobs)

    def _packed_forward(self, padded: torch.Tensor, cache_rows: list[int], lengths: list[int],
                        bins: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, list[tuple[int, int]]]:
        """The prefill forward of the right-padded prompts ``padded (n, W)`` packed into ``bins``: the ids fed
        ``(B, W)``, hidden states ``(B, W, d)`` and each prompt's ``(bin, offset)``."""
        width = padded.shape[1]
        ids, pos, doc, places = self._pack(padded, lengths, bins)
        ids, pos, doc = ids.to(self.device), pos.to(self.device), doc.to(self.device)
        rows = self._fetch(ids)
        cache = self.cache.packed(cache_rows, places, lengths, width)
        return ids, self.model(ids, start_pos=0, cache=cache, positions=pos, doc_ids=doc, return_hidden=True,
                               table_rows=rows), places

    def _pack(self, padded: torch.Tensor, lengths: list[int], bins: list[list[int]]
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[tuple[int, int]]]:
        """The prompts ``padded (n, W)`` packed into ``bins`` (host): ids, positions and document ids ``(B, W)``
        (padding a document of its own, ``-1``) and each prompt's ``(bin, offset)``."""
        width = padded.shape[1]
        ids = torch.full((len(bins), width), self.pad_id, dtype=torch.long)
        pos = torch.zeros((len(bins), width), dtype=torch.long)
        doc = torch.full((len(bins), width), -1, dtype=torch.long)
        places: list[tuple[int, int]] = [(0, 0)] * len(lengths)
        for b, members in enumerate(bins):
            off = 0
            for j in members:
                n = lengths[j]
                ids[b, off:off + n] = padded[j, :n]
                pos[b, off:off + n] = torch.arange(n)
                doc[b, off:off + n] = j
                places[j] = (b, off)
                off += n
        return ids, pos, doc, places

    # -- decoding -----------------------------------------------------------------------------
    def merges(self) -> bool:
        """Whether ``step`` can take newcomers (``join``) into its forward now: an eager core (not the static or
        graph step) with rows running, of a model without n-gram keys (their prompts are not packed)."""
        return self.static is None and not self.reach and bool(self.running)

    @torch.no_grad()
    def step(self, join: Seq[Generation] = ()) -> Progress:
        """One forward over every running sequence, feeding each its last token; sample the next.

        ``join``: newcomers prefilled in the same forward (a prefill merged into the step, where ``add`` and
        ``step`` would run two forwards; only while ``merges()``): their prompts, packed as ``add`` packs them,
        follow the running rows' tokens in one sequence, and each samples its first token. Each part attends
        as it would alone (``SlotCache.mixed``), so the tokens are those of ``add`` then ``step`` (for sequences with
        generators of their own, as the engine's: shared ones are drawn in another order); the newcomers decode
        their second token at the next step."""
        if join:
            if not self.merges():
                raise ValueError("this core cannot merge a prefill into its step now (see DecodeCore.merges); "
                                 "add the newcomers first")
            return self._merged_step(join)
        seqs = self.running
        if not seqs:
            return Progress([], [])
        tokens = [s.tokens[-1] for s in seqs]
        slots = [s.next_slot for s in seqs]
        rows, self._ticket = self._ticket, None  # prefetched by _retire for exactly these tokens
        if self.static is not None:
            logits = self.static(tokens, slots, rows, self._context(seqs))
        else:
            keys = self._step_keys(seqs) if rows is None else None
            if keys is not None:  # n-gram keys hashed from the token lists: the rows for exactly these keys
                rows = self.model.tables.rows(keys.to(self.device))
            context = None if keys is not None or rows is not None else self._context(seqs)
            logits = self._eager_step(tokens, slots, rows, None if context is None else context.to(self.device))
        emitted = self._sample(seqs, logits)
        return Progress(emitted, self._retire(), None, [1] * len(seqs))

    def _merged_step(self, join: Seq[Generation]) -> Progress:
        fresh, done = self._prepare(join)
        if not fresh:
            progress = self.step()
            return Progress(progress.emitted, done + progress.finished)
        seqs, n = self.running, len(self.running)
        tokens, slots = [s.tokens[-1] for s in seqs], [s.next_slot for s in seqs]
        lengths = [len(s.prompt) for s in fresh]
        width, span = max(lengths), max(slots) + 1
        self._ticket = None  # the forward gathers the rows of all its ids itself
        self.running = seqs + fresh
        cache_rows = list(range(n, len(self.running)))
        self._reserve(len(self.running), max(span, width + 1))
        padded = self._padded(fresh, width)
        bins = pack_prompts(lengths, width)
        packed, pos, doc, places = self._pack(padded, lengths, bins)
        ids = torch.cat((torch.tensor(tokens), packed.reshape(-1)))[None].to(self.device)  # (1, n + B·W)
        positions = torch.cat((torch.tensor(slots), pos.reshape(-1)))[None].to(self.device)  # (1, n + B·W)
        step_pos = positions[0, :n]
        cache = self.cache.mixed(step_pos, span, ragged_mask(torch.arange(span, device=self.device), step_pos,
                                                             self.cache.dtype),
                                 cache_rows, places, lengths, width, attention_mask(doc.to(self.device), 0, width,
                                                                                    self.device))
        rows = self._fetch(ids)
        hidden = self.model(ids, start_pos=0, cache=cache, positions=positions, return_hidden=True,
                            table_rows=rows)[0]  # (n + B·W, d)
        starts = [n + b * width + off for b, off in places]  # each prompt's first token in the sequence
        last = torch.tensor(list(range(n)) + [at + m - 1 for at, m in zip(starts, lengths)], device=self.device)
        logits = self.model.lm_head(hidden[last])  # (n + len(fresh), V)
        self._prompt_logprobs(fresh, lambda j: hidden[starts[j]:starts[j] + lengths[j] - 1])
        emitted = self._sample(seqs, logits[:n]) + self._first_tokens(fresh, logits[n:])
        return Progress(emitted, done + self._retire(), padded, lengths, packed)

    def _context(self, seqs: list[Generation]) -> torch.Tensor | None:
        """``(n, reach)`` on the host: each sequence's tokens before the one it feeds next (``-1`` before
        its start), which the n-gram keys of that token hash; None for a model without n-gram rows."""
        if not self.reach:
            return None
        r = self.reach
        tails = (last_tokens(s, r + 1)[:-1] for s in seqs)  # the r tokens before the last one
        return torch.tensor([[-1] * (r - len(tail)) + tail for tail in tails], dtype=torch.long)

    def _step_keys(self, seqs: list[Generation]) -> torch.Tensor | None:
        """Keys ``(n, 1, K)`` (on the host) of the tokens the next step feeds, for a model whose tables are all
        n-gram keyed, hashed from each sequence's last tokens (``NgramKeys.newest``); None for other models
        (and with ``ngram_normalize``), which key their rows from the ids and ``_context``."""
        keys_of = self.model.ngram_keys
        if not self.reach or keys_of is None or self.model.mixed_keys:
            return None
        return keys_of.newest([last_tokens(s, self.reach + 1) for s in seqs])  # the fed token and the reach before it

    def _eager_step(self, tokens: list[int], slots: list[int], rows=None, context=None) -> torch.Tensor:
        span = max(slots) + 1
        self._reserve(len(tokens), span)
        ids = torch.tensor(tokens, dtype=torch.long, device=self.device)[:, None]  # (n, 1)
        if min(slots) == span - 1:  # every row at the same position: plain cached decode
            return self.model(ids, start_pos=span - 1, cache=self.cache.uniform(len(tokens), span),
                              table_rows=rows, context=context)[:, -1]
        pos = torch.tensor(slots, device=self.device)  # (n,)
        mask = ragged_mask(torch.arange(span, device=self.device), pos, self.cache.dtype)  # (n, 1, 1, S)
        return self.model(ids, start_pos=0, cache=self.cache.ragged(pos, span), positions=pos[:, None],
                          attn_mask=mask, table_rows=rows, context=context)[:, -1]

    def _reserve(self, rows: int, length: int) -> None:
        if self.static is None:
            self.cache.reserve(rows, min(length, self.max_len))

    def _sample(self, seqs: list[Generation], logits: torch.Tensor) -> list[Generation]:
        """A token per row of ``logits (n, V)`` for ``seqs``; marks those that end."""
        tokens = sample_rows(logits, [s.params for s in seqs], [s.generator for s in seqs])
        for j, (s, tok) in enumerate(zip(seqs, tokens)):
            s.tokens.append(tok)
            if s.logprobs is not None:
                s.token_logprobs += token_logprobs(logits[j:j + 1], [tok], s.logprobs)
            if tok in self.eos_ids or (s.stop is not None and s.stop(s.tokens)):
                s.finish_reason = "stop"
            elif len(s.tokens) >= s.budget:
                s.finish_reason = "length"
        return list(seqs)

    # -- leaving ------------------------------------------------------------------------------
    def drop(self, seqs: Seq[Generation], reason: str = "cancelled") -> None:
        """Take ``seqs`` out of the batch (``finish_reason = reason``); the others go on."""
        for s in seqs:
            s.finish_reason = reason
        self._retire()

    def _retire(self) -> list[Generation]:
        """Remove finished rows from the batch and the cache; prefetch the next step's rows (the ticket is
        kept for ``step``: every change of the running batch passes here, so it is always for its tokens)."""
        done = [s for s in self.running if s.finish_reason is not None]
        if done:
            kept = [j for j, s in enumerate(self.running) if s.finish_reason is None]
            length = max(s.next_slot for s in self.running) + 1
            self.running = [self.running[j] for j in kept]
            if kept:
                self.cache.keep(kept, min(length, self.cache.max_len))
        self._ticket = None
        if self.running and self._prefetch:
            device = "cpu" if self.static is not None else self.device  # ids as the step will look them up
            keys = self._step_keys(self.running) if self.static is None else None
            if keys is not None:
                self._ticket = self.store.prefetch(keys.to(device))
            else:
                ids = torch.tensor([s.tokens[-1] for s in self.running], device=device)[:, None]
                context = self._context(self.running)
                self._ticket = self.model.prefetch_rows(ids, None if context is None else context.to(device),
                                                        self.store)
        return done
