"""A fast ``LanguageModel``: batched scoring with each shared context run once, batched greedy decoding.

Scoring. Requests are tokenized as the harness does (``api.encode_pair``), cut to ``max_length``
from the left, deduplicated and grouped by context. The continuations of one context are packed
into one row behind a single copy of it::

    tokens     c0 c1 c2 | a0 a1 | b0 b1 b2        (context, then choice a, then choice b, minus last tokens)
    positions   0  1  2 |  3  4 |  3  4  5
    attends    causal   | context + own choice

so the context is computed once for all its choices, every choice sees exactly the positions
and keys it would see alone, and the LM head runs only where a continuation token is predicted.
A batch in which no row holds more than one continuation (rolling windows, single requests)
runs plain causal attention instead, which is faster than a masked one.
Rows are sorted by length and batched up to ``batch_size`` continuations; table rows are
gathered once per batch (deduplicated lookups, and the table store's prefetch when the tables
are offloaded). Everything runs under ``torch.no_grad``.

Generation. Prompts are sorted by length and decoded greedily in batches of ``batch_size`` with
a KV cache; shorter prompts are left-padded and get their own positions (``positions``) and a
mask that hides the padding, so every row computes what it would alone. Finished rows (stop
token, stop sequence, budget) leave the batch and the cache.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..inference.batch_generate import SamplingParams, generate_batch
from .api import (GenerateRequest, Loglikelihood, LoglikelihoodRequest, Tokens, check_request_ids, cut_at_stop,
                  encode_pair, generation_prompt, rolling_prefix, rolling_windows, sum_loglikelihoods)

HEAD_CHUNK_ELEMENTS = 1 << 24  # logits formed at once in the LM head (64 MB in fp32)

Pair = tuple[tuple[int, ...], tuple[int, ...]]  # (context ids, continuation ids)


class EvalEngine:
    """``LanguageModel`` over a ``StemLM`` (any FFN kind, tables on any tier); see the module docstring."""

    def __init__(self, model, tokens: Tokens, max_length: int | None = None, batch_size: int = 32,
                 identity: str = "engine"):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.model, self.tokens, self.batch_size, self.identity = model.eval(), tokens, batch_size, identity
        self.vocab_size = model.cfg.vocab_size
        self.max_length = min(max_length or model.cfg.max_seq_len, model.cfg.max_seq_len)

    # -- the LanguageModel API ---------------------------------------------------------------
    def loglikelihood(self, requests: Sequence[LoglikelihoodRequest]) -> list[Loglikelihood]:
        """Summed log-prob of each continuation given its context."""
        return self.score_pairs([encode_pair(self.tokens, r.context, r.continuation) for r in requests])

    def loglikelihood_rolling(self, texts: Sequence[str]) -> list[Loglikelihood]:
        """Log-prob of each whole text, over the harness's rolling windows of ``max_length``."""
        prefix = rolling_prefix(self.tokens)
        windows = [rolling_windows(self.tokens.encode(t), prefix, self.max_length) for t in texts]
        scores = iter(self.score_pairs([w for ws in windows for w in ws]))
        return [sum_loglikelihoods([next(scores) for _ in ws]) for ws in windows]

    def generate_until(self, requests: Sequence[GenerateRequest]) -> list[str]:
        """Greedy continuations, ended by the stop token and cut at the first stop sequence."""
        prompts = [generation_prompt(self.tokens, r.context, r.max_new_tokens, self.max_length) for r in requests]
        order = sorted(range(len(requests)), key=lambda i: -len(prompts[i][0]))
        out: list[str] = [""] * len(requests)
        for start in range(0, len(order), self.batch_size):
            batch = order[start:start + self.batch_size]
            texts = self._generate_batch([prompts[i] for i in batch], [requests[i].until for i in batch])
            for i, text in zip(batch, texts):
                out[i] = text
        return out

    # -- scoring -----------------------------------------------------------------------------
    def _fit(self, ctx: Sequence[int], cont: Sequence[int]) -> Pair:
        """Check ids and cut the context from the left so that context + continuation fit ``max_length + 1``."""
        check_request_ids(list(ctx) + list(cont), self.vocab_size)
        if len(cont) > self.max_length:
            raise ValueError(f"a continuation of {len(cont)} tokens is longer than max_length={self.max_length}")
        cut = max(0, len(ctx) + len(cont) - (self.max_length + 1))
        return tuple(ctx[cut:]), tuple(cont)

    def _rows(self, pairs: Sequence[Pair]) -> list[tuple[tuple[int, ...], list[tuple[int, ...]]]]:
        """``(context, continuations)`` rows: each context once, its continuations packed behind it
        while the row fits ``max_length`` tokens; longest rows first. A model with n-gram keys gets one
        continuation per row: a packed continuation's n-grams would hash the one before it."""
        pack = getattr(self.model, "ngram_keys", None) is None
        by_ctx: dict[tuple[int, ...], list[tuple[int, ...]]] = {}
        for ctx, cont in dict.fromkeys(pairs):
            by_ctx.setdefault(ctx, []).append(cont)
        rows = []
        for ctx, conts in by_ctx.items():
            row: list[tuple[int, ...]] = []
            length = len(ctx)
            for cont in sorted(conts, key=len, reverse=True):
                if row and (not pack or length + len(cont) - 1 > self.max_length):
                    rows.append((ctx, row))
                    row, length = [], len(ctx)
                row.append(cont)
                length += len(cont) - 1
            rows.append((ctx, row))
        return sorted(rows, key=lambda r: -(len(r[0]) + sum(len(c) - 1 for c in r[1])))

    def score_pairs(self, pairs: Sequence[tuple[Sequence[int], Sequence[int]]]) -> list[Loglikelihood]:
        """Answers for token-level ``(context, continuation)`` pairs (the context non-empty)."""
        fitted = [self._fit(ctx, cont) for ctx, cont in pairs]
        answers: dict[Pair, Loglikelihood] = {}
        batch: list = []
        for row in self._rows(fitted):
            if batch and sum(len(r[1]) for r in batch) + len(row[1]) > self.batch_size:
                answers.update(self._score_batch(batch))
                batch = []
            batch.append(row)
        if batch:
            answers.update(self._score_batch(batch))
        return [answers[p] for p in fitted]

    @torch.no_grad()
    def _score_batch(self, rows) -> dict[Pair, Loglikelihood]:
        """Run one packed batch; the answer of every (context, continuation) in it."""
        device = next(self.model.parameters()).device
        width = max(len(ctx) + sum(len(c) - 1 for c in conts) for ctx, conts in rows)
        ids = torch.full((len(rows), width), self.tokens.eot_id, dtype=torch.long)
        pos = torch.zeros((len(rows), width), dtype=torch.long)
        seg = torch.full((len(rows), width), -1, dtype=torch.long)  # 0 = context, k = k-th continuation, -1 = pad
        where, targets, owners = [], [], []  # flat index of each predicting position, its target, its pair
        for r, (ctx, conts) in enumerate(rows):
            c = len(ctx)
            ids[r, :c], pos[r, :c], seg[r, :c] = torch.tensor(ctx), torch.arange(c), 0
            at = c
            for k, cont in enumerate(conts, start=1):
                n = len(cont) - 1
                ids[r, at:at + n], pos[r, at:at + n], seg[r, at:at + n] = torch.tensor(cont[:-1]), torch.arange(c, c + n), k
                where += [r * width + c - 1] + [r * width + j for j in range(at, at + n)]
                targets += cont
                owners += [(ctx, cont)] * len(cont)
                at += n
        ids = ids.to(device)
        table_rows = self.model.prefetch_rows(ids)  # the rows are gathered while the mask is built
        if all(len(conts) == 1 for _, conts in rows):  # nothing packed: plain causal (right padding is never seen)
            hidden = self.model(ids, return_hidden=True, table_rows=table_rows)
        else:
            causal = torch.ones(width, width, dtype=torch.bool).tril()  # (T, S)
            visible = (seg[:, None, :] == 0) | (seg[:, None, :] == seg[:, :, None])  # (B, T, S)
            mask = (causal & visible)[:, None]  # (B, 1, T, S)
            hidden = self.model(ids, positions=pos.to(device), attn_mask=mask.to(device), return_hidden=True,
                                table_rows=table_rows)
        logprob, greedy = self._head(hidden.reshape(-1, hidden.shape[-1]), torch.tensor(where, device=device),
                                     torch.tensor(targets, device=device))  # hidden (B*T, d)
        out: dict[Pair, list] = {}
        for owner, lp, g in zip(owners, logprob.tolist(), greedy.tolist()):
            acc = out.setdefault(owner, [0.0, 0, True])
            acc[0] += lp
            acc[1] += 1
            acc[2] = acc[2] and g
        return {pair: Loglikelihood(lp, n, g) for pair, (lp, n, g) in out.items()}

    def _head(self, hidden: torch.Tensor, where: torch.Tensor, targets: torch.Tensor):
        """Log-prob of ``targets (M,)`` predicted at ``hidden[where]`` and whether each is the argmax;
        each distinct position goes through the LM head once, in chunks."""
        uniq, inverse = torch.unique(where, return_inverse=True)
        h = hidden.index_select(0, uniq)  # (U, d)
        weight = self.model.lm_head.weight
        chunk = max(1, HEAD_CHUNK_ELEMENTS // weight.shape[0])
        best = []
        picked = torch.empty(len(targets), dtype=torch.float32, device=hidden.device)
        for a in range(0, len(uniq), chunk):
            logits = self.model.lm_head(h[a:a + chunk]).float()  # (c, V)
            best.append(logits.argmax(-1))
            logp = logits.log_softmax(-1)  # as the harness and ReferenceLM (logsumexp rounds differently)
            sel = ((inverse >= a) & (inverse < a + chunk)).nonzero(as_tuple=True)[0]
            picked[sel] = logp[inverse[sel] - a, targets[sel]]
        return picked, torch.cat(best)[inverse] == targets

    # -- generation --------------------------------------------------------------------------
    def _generate_batch(self, prompts: list[tuple[list[int], int]], untils: list[Sequence[str]]) -> list[str]:
        """Greedy decoding of the prompts as one batch (``batch_generate``); the cut text of each."""
        for ids, _ in prompts:
            check_request_ids(ids, self.vocab_size)
        stop_id = getattr(self.tokens, "stop_id", None)
        new = generate_batch(self.model, [p for p, _ in prompts], [SamplingParams(n) for _, n in prompts],
                             eos_id=stop_id, pad_id=self.tokens.eot_id,
                             stop=lambda r, toks: any(s in self.tokens.decode(toks) for s in untils[r]))
        new = [n[:-1] if n and n[-1] == stop_id else n for n in new]
        return [cut_at_stop(self.tokens.decode(n), u) for n, u in zip(new, untils)]
