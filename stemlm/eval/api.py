"""The seam between evaluation tasks and the model that answers them.

It has the shape of lm-evaluation-harness's ``LM`` API, so one model adapter serves stemlm's own
tasks and the harness alike: ``loglikelihood`` of a continuation given a context,
``loglikelihood_rolling`` of a whole text, and ``generate_until`` a stop sequence. Tasks build
requests from strings and never see token ids; a ``LanguageModel`` never sees a task.

``encode_pair`` is the harness's tokenization of a (context, continuation) pair: trailing
whitespace of the context moves to the continuation, the pair is encoded whole, and the
continuation's tokens are those past the context's. ``ReferenceLM`` answers every request with
one plain forward pass of its own: slow, obviously right, and the yardstick of faster engines.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch


@dataclass(frozen=True)
class LoglikelihoodRequest:
    """log P(continuation | context), summed over the continuation's tokens."""

    context: str
    continuation: str


@dataclass(frozen=True)
class GenerateRequest:
    """Greedy continuation of ``context``, cut before the first of ``until`` (at most ``max_new_tokens``)."""

    context: str
    until: tuple[str, ...] = ()
    max_new_tokens: int = 32


@dataclass(frozen=True)
class Loglikelihood:
    """Answer to a ``LoglikelihoodRequest``: summed log-prob, token count, and whether greedy decoding
    would have produced exactly the continuation."""

    logprob: float
    n_tokens: int
    is_greedy: bool


class Tokens(Protocol):
    """What the seam needs of a tokenizer (``stemlm.data.codec.TextCodec`` is one)."""

    prefix_ids: list[int]  # put before every context (stemlm: the document-start token; HF Llama: none)
    eot_id: int  # the end-of-text token: the whole context of a request whose context is empty
    # optional ``stop_id``: generation ends when the model produces it (absent or None: never)

    def encode(self, text: str) -> list[int]:
        """Ids of ``text`` without any special tokens."""

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids`` (special tokens dropped)."""


class LanguageModel(Protocol):
    """A model that answers evaluation requests (see the module docstring)."""

    identity: str  # stable id of the weights (hash); keys the per-request result cache
    max_length: int  # longest token sequence the model accepts

    def loglikelihood(self, requests: Sequence[LoglikelihoodRequest]) -> list[Loglikelihood]: ...

    def loglikelihood_rolling(self, texts: Sequence[str]) -> list[Loglikelihood]: ...

    def generate_until(self, requests: Sequence[GenerateRequest]) -> list[str]: ...


def encode_pair(tokens: Tokens, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """``(context_ids, continuation_ids)`` as the harness tokenizes them; ``prefix_ids`` lead the
    context, and a context that is still empty becomes ``[eot_id]`` (as in the harness)."""
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        continuation, context = context[-n_spaces:] + continuation, context[:-n_spaces]
    whole = tokens.encode(context + continuation)
    ctx = tokens.encode(context)
    cont = whole[len(ctx):]
    if not cont:
        raise ValueError(f"continuation {continuation!r} encodes to no tokens")
    ctx = list(tokens.prefix_ids) + ctx
    if not ctx:  # the harness: the end-of-text token, unless the continuation already starts with it
        ctx, cont = ([tokens.eot_id], cont) if cont[0] != tokens.eot_id or len(cont) == 1 else (cont[:1], cont[1:])
    return ctx, cont


def rolling_windows(ids: list[int], prefix_id: int, max_length: int) -> list[tuple[list[int], list[int]]]:
    """The harness's disjoint rolling windows ``(context, continuation)`` that score every token of
    ``ids`` once: the first window is conditioned on ``prefix_id``, each later one on the
    ``max_length - n`` tokens before its ``n`` new tokens (``get_rolling_token_windows`` with
    ``context_len=1``, then ``make_disjoint_window``)."""
    if not ids:
        return []
    first = min(max_length, len(ids))
    windows = [([prefix_id] + ids[:first - 1], ids[:first])]
    done = first
    while done < len(ids):
        n = min(len(ids) - done, max_length)
        end = done + n  # >= max_length + 1, so the slice start is never negative
        windows.append((ids[end - max_length - 1:end - 1], ids[end - n:end]))
        done = end
    return [(ctx[:len(ctx) - (len(cont) - 1)], cont) for ctx, cont in windows]


def generation_prompt(tokens: Tokens, context: str, max_new_tokens: int, max_length: int) -> tuple[list[int], int]:
    """``(prompt ids, new-token budget)`` of a generation request: ``prefix_ids`` + the context, its
    start cut so that prompt and new tokens fit ``max_length`` (as the harness does), at least one
    token (``eot_id`` for an empty prompt)."""
    ids = (list(tokens.prefix_ids) + tokens.encode(context)) or [tokens.eot_id]
    ids = ids[-max(1, max_length - max_new_tokens):]
    return ids, max(0, min(max_new_tokens, max_length - len(ids) + 1))  # the last new token is never fed back


def check_request_ids(ids: Sequence[int], vocab_size: int) -> None:
    """A one-line error when a request encodes to ids the model does not have."""
    if ids and max(ids) >= vocab_size:
        raise ValueError(f"a request encodes to token id {max(ids)}, beyond the model's vocabulary of "
                         f"{vocab_size}: the tokenizer does not belong to this model")


class ReferenceLM:
    """One full forward per request, no batching, no cache: the correctness yardstick.

    ``model(ids (1, T)) -> logits (1, T, V)``; contexts longer than ``max_length`` keep their end.
    """

    def __init__(self, model, tokens: Tokens, vocab_size: int, max_length: int, identity: str = "reference"):
        self.model, self.tokens, self.vocab_size = model, tokens, vocab_size
        self.max_length, self.identity = max_length, identity

    @torch.no_grad()
    def _score(self, ctx: list[int], cont: list[int]) -> Loglikelihood:
        ids = (ctx + cont)[-(self.max_length + 1):]
        check_request_ids(ids, self.vocab_size)
        x = torch.tensor([ids[:-1]], dtype=torch.long)
        logp = self.model(x)[0, -len(cont):].float().log_softmax(-1)  # (n_cont, V)
        target = torch.tensor(cont)
        picked = logp.gather(-1, target[:, None]).squeeze(-1)
        greedy = bool((logp.argmax(-1) == target).all())
        return Loglikelihood(float(picked.sum()), len(cont), greedy)

    def loglikelihood(self, requests: Sequence[LoglikelihoodRequest]) -> list[Loglikelihood]:
        """Summed log-prob of each continuation."""
        return [self._score(*encode_pair(self.tokens, r.context, r.continuation)) for r in requests]

    def loglikelihood_rolling(self, texts: Sequence[str]) -> list[Loglikelihood]:
        """Log-prob of each whole text after the prefix token, over the harness's rolling windows."""
        out = []
        for text in texts:
            parts = [self._score(c, t) for c, t in rolling_windows(self.tokens.encode(text), rolling_prefix(self.tokens),
                                                                   self.max_length)]
            out.append(sum_loglikelihoods(parts))
        return out

    @torch.no_grad()
    def generate_until(self, requests: Sequence[GenerateRequest]) -> list[str]:
        """Greedy decoding by repeated full forwards, ended by ``stop_id`` and cut at the first stop sequence."""
        out = []
        stop_id = getattr(self.tokens, "stop_id", None)
        for r in requests:
            ids, n_new = generation_prompt(self.tokens, r.context, r.max_new_tokens, self.max_length)
            new: list[int] = []
            for _ in range(n_new):
                token = int(self.model(torch.tensor([ids + new], dtype=torch.long))[0, -1].argmax())
                if token == stop_id:
                    break
                new.append(token)
                if any(s in self.tokens.decode(new) for s in r.until):
                    break
            out.append(cut_at_stop(self.tokens.decode(new), r.until))
        return out


def rolling_prefix(tokens: Tokens) -> int:
    """The token the first rolling window is conditioned on (the harness's ``prefix_token_id``)."""
    return (list(tokens.prefix_ids) or [tokens.eot_id])[-1]


def sum_loglikelihoods(parts: Sequence[Loglikelihood]) -> Loglikelihood:
    """One answer for a text scored in several windows."""
    return Loglikelihood(sum(p.logprob for p in parts), sum(p.n_tokens for p in parts), all(p.is_greedy for p in parts))


def cut_at_stop(text: str, until: Sequence[str]) -> str:
    """``text`` up to (not including) the earliest stop sequence."""
    cuts = [text.find(s) for s in until if s and s in text]
    return text[:min(cuts)] if cuts else text
