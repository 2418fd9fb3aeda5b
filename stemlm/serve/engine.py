"""The continuous-batching engine: one thread owns the model and decodes every admitted request.

Requests wait in a queue. Before each decode step the engine admits waiting requests (up to
``max_batch`` rows), prefills them as one group, samples their first token and merges their KV
cache into the running batch (``RunningBatch.join``); after each step, requests that finished or
were cancelled leave it. A newcomer therefore waits at most one step plus its own prefill, never
for the batch to finish. Each request samples from its own row with its own seeded generator
(``batch_generate.sample_rows``), so its tokens are those it gets decoded alone.

Events go to the request's ``sink`` (called on the engine thread; the HTTP layer hands them to
its event loop): ``PromptLogprobs`` (if asked), one ``Token`` per new token, then ``Finished``.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from ..inference.batch_generate import SamplingParams, sample_rows
from ..inference.generate import _generator
from .batch import RunningBatch
from .metrics import Metrics

log = logging.getLogger(__name__)


@dataclass
class Token:
    """A new token, its log-probability and the ``top`` alternatives (``(id, logprob)``) if asked."""

    id: int
    logprob: float | None = None
    top: list[tuple[int, float]] | None = None


@dataclass
class PromptLogprobs:
    """``(logprob, top)`` of every prompt token (``(None, None)`` for the first, which has no context)."""

    entries: list[tuple[float | None, list[tuple[int, float]] | None]]


@dataclass
class Finished:
    """The request is over: ``reason`` is ``stop``, ``length``, ``cancelled`` or ``error`` (with ``message``)."""

    reason: str
    message: str = ""


@dataclass(eq=False)
class Request:
    """One prompt to decode. ``stop(tokens)`` ends it early; ``logprobs``/``prompt_logprobs`` ask for
    that many alternatives per generated / prompt token (0 = only the chosen token's)."""

    prompt: list[int]
    params: SamplingParams
    sink: Callable[[object], None]
    stop: Callable[[list[int]], bool] | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    cancelled: bool = False  # set by the HTTP layer; the engine drops the request at its next step
    tokens: list[int] = field(default_factory=list)

    def cancel(self) -> None:
        """Ask the engine to drop this request (its slot is freed at the next step)."""
        self.cancelled = True


class EngineClosed(RuntimeError):
    """The engine is shutting down and takes no new requests."""


class Engine:
    """Owns ``model`` on a background thread and serves ``Request``s by continuous batching.

    A request ends when it produces one of the ``eos_id`` tokens (one id or several, e.g. a chat
    model's end of turn), meets its ``stop`` test or uses up its budget."""

    def __init__(self, model, eos_id: int | Sequence[int] | None = None, max_batch: int = 16, store=None,
                 metrics: Metrics | None = None):
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        eos = [] if eos_id is None else [eos_id] if isinstance(eos_id, int) else list(eos_id)
        self.model, self.eos_ids, self.max_batch = model, frozenset(eos), max_batch
        self.store, self.metrics = store, metrics or Metrics()
        self.batch = RunningBatch(model, pad_id=eos[0] if eos else 0, store=store)
        self.running: list[Request] = []  # in batch row order
        self._budget: dict[Request, int] = {}
        self._generators: dict[Request, torch.Generator | None] = {}
        self._waiting: deque[Request] = deque()
        self._cond = threading.Condition()
        self._closing = False
        self._thread: threading.Thread | None = None

    # -- the public face ------------------------------------------------------------------------
    def start(self) -> Engine:
        """Start the engine thread (once)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="stemlm-engine", daemon=True)
            self._thread.start()
        return self

    def submit(self, req: Request) -> None:
        """Queue ``req``; ``EngineClosed`` once shutdown has begun."""
        with self._cond:
            if self._closing:
                raise EngineClosed("the server is shutting down")
            self._waiting.append(req)
            self.metrics.queued(1)
            self._cond.notify()

    def counts(self) -> dict:
        """Requests running and waiting right now."""
        with self._cond:
            return {"requests_running": len(self.running), "requests_queued": len(self._waiting)}

    def shutdown(self, drain: bool = True, timeout: float | None = None) -> None:
        """Refuse new requests, finish (``drain``) or cancel the others, and stop the thread."""
        with self._cond:
            self._closing = True
            if not drain:
                for req in [*self._waiting, *self.running]:
                    req.cancel()
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    # -- the engine thread ----------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._waiting and not self.running and not self._closing:
                    self._cond.wait()
                if self._closing and not self._waiting and not self.running:
                    return
                room = self.max_batch - len(self.running)
                newcomers = [self._waiting.popleft() for _ in range(min(room, len(self._waiting)))]
                self.metrics.queued(-len(newcomers))
            try:
                if newcomers:
                    self._admit(newcomers)
                if self.running:
                    self._decode()
            except Exception as e:  # a failed forward must not kill the server: fail the requests involved
                log.exception("engine step failed")
                with self._cond:  # a fresh batch before anyone hears of the failure
                    self.running, self.batch = [], RunningBatch(self.model, self.batch.pad_id, self.store)
                for req in list(self._budget):  # every request the engine still owns
                    self._finish(req, "error", f"{type(e).__name__}: {e}")

    def _admit(self, newcomers: list[Request]) -> None:
        """Prefill the newcomers as one group, emit their first token and merge the rest into the batch."""
        max_len = self.model.cfg.max_seq_len
        group = []
        for req in newcomers:
            budget = min(req.params.max_new_tokens, max_len - len(req.prompt) + 1)
            if req.cancelled:
                self._finish(req, "cancelled")
            elif budget <= 0 and req.prompt_logprobs is None:
                self._finish(req, "length")
            else:
                self._budget[req], self._generators[req] = budget, _generator(req.params.seed, self.batch.device)
                group.append(req)
        if not group:
            return
        self.metrics.admitted(len(group), sum(len(r.prompt) for r in group))
        cached, logits = self.batch.prefill([r.prompt for r in group])  # logits (n, W, V)
        width = logits.shape[1]
        for j, req in enumerate(group):
            if req.prompt_logprobs is not None:
                start = width - len(req.prompt)  # the row's first real slot
                _send(req, PromptLogprobs([(None, None)] + _logprobs(logits[j, start:-1], req.prompt[1:], req.prompt_logprobs)))
        going = [j for j, req in enumerate(group) if self._budget[req] > 0]
        for j in set(range(len(group))) - set(going):
            self._finish(group[j], "length")
        kept = self._sample_and_emit([group[j] for j in going], logits[going, -1])
        if not kept:
            return
        cache, pad, w = cached
        rows = torch.tensor([going[j] for j in kept], device=pad.device)
        cache.keep_rows(rows)
        joining = [group[going[j]] for j in kept]
        room = max(self._budget[r] - len(r.tokens) for r in self.running + joining)
        self.batch.join((cache, pad[rows], w), room)
        with self._cond:
            self.running += joining

    def _decode(self) -> None:
        """One forward of the running batch; cancelled requests leave before it, finished ones after."""
        live = [j for j, r in enumerate(self.running) if not r.cancelled]
        for req in self.running:
            if req.cancelled:
                self._finish(req, "cancelled")
        self._keep(live)
        if not self.running:
            return
        logits = self.batch.step([r.tokens[-1] for r in self.running])  # (B, V)
        self._keep(self._sample_and_emit(self.running, logits))

    def _keep(self, rows: list[int]) -> None:
        self.batch.keep(rows)
        with self._cond:
            self.running = [self.running[j] for j in rows]

    def _sample_and_emit(self, reqs: list[Request], logits: torch.Tensor) -> list[int]:
        """Sample a token per row of ``logits (n, V)``, hand it out; the indices of the requests that go on."""
        tokens = sample_rows(logits, [r.params for r in reqs], [self._generators[r] for r in reqs])
        going = []
        for j, (req, tok) in enumerate(zip(reqs, tokens)):
            req.tokens.append(tok)
            if req.logprobs is not None:
                (lp, top), = _logprobs(logits[j:j + 1], [tok], req.logprobs)
                _send(req, Token(tok, lp, top))
            else:
                _send(req, Token(tok))
            if tok in self.eos_ids or (req.stop is not None and req.stop(req.tokens)):
                self._finish(req, "stop")
            elif len(req.tokens) >= self._budget[req]:
                self._finish(req, "length")
            else:
                going.append(j)
        self.metrics.generated(len(tokens))
        if going and self.store is not None:  # the next step's rows, gathered while this step is handed out
            self.store.prefetch(torch.tensor([tokens[j] for j in going], device=logits.device)[:, None])
        return going

    def _finish(self, req: Request, reason: str, message: str = "") -> None:
        self._budget.pop(req, None)
        self._generators.pop(req, None)
        self.metrics.finished(reason)
        _send(req, Finished(reason, message))


def _send(req: Request, event) -> None:
    """Hand ``event`` to the request's sink; a sink that fails cancels its own request, no other."""
    try:
        req.sink(event)
    except Exception:
        log.exception("a request's event sink failed; the request is dropped")
        req.cancel()


def _logprobs(logits: torch.Tensor, chosen: list[int], k: int) -> list[tuple[float, list[tuple[int, float]] | None]]:
    """``(logprob of chosen[i], top-k (id, logprob) or None if k == 0)`` for every row of ``logits (n, V)``."""
    lp = torch.log_softmax(logits.float(), dim=-1)  # (n, V)
    picked = lp.gather(-1, torch.tensor(chosen, device=lp.device)[:, None])[:, 0].tolist()  # (n,)
    if k == 0:
        return [(p, None) for p in picked]
    values, ids = lp.topk(min(k, lp.shape[-1]), dim=-1)  # (n, k)
    return [(p, list(zip(i, v))) for p, i, v in zip(picked, ids.tolist(), values.tolist())]
