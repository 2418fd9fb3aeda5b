"""The continuous-batching engine: one thread owns the model and schedules requests onto the decode core.

That thread is the engine's own (``start``) or an event loop's (``run_async``:
``stemlm serve`` runs the engine as a task of uvicorn's loop on the main thread, which loaded the model, so
that one OpenMP team does the model's work, ``stemlm.runtime.threads``, and HTTP's work runs between decode
steps); ``call`` runs other work on it between requests.

Requests wait in a queue (at most ``max_queue``). Before each decode step the engine drops the
requests that were cancelled or ran past their deadline and admits waiting ones (up to ``max_batch``
rows) as one group: while rows are running, the group's prefill (into free rows of the KV cache, and
the first token) is merged into the step's forward (``DecodeCore.step(join=...)``); into an idle
batch it is a forward of its own (``DecodeCore.add``) before the step. A newcomer therefore waits at
most one step plus its own prefill, never for the batch to finish. Decoding itself (sampling, stops,
retirement, prefetch of the next step's rows) is the core's (``stemlm.inference.core``); the engine
adds scheduling, cancellation, deadlines and events.

Events go to the request's ``sink`` (called on the engine thread; the HTTP layer hands them to
its event loop): ``PromptLogprobs`` (if asked), one ``Token`` per new token, then ``Finished``.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

from ..inference.core import DecodeCore, Generation
from ..inference.sampling import SamplingParams
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
    """The request is over: ``reason`` is ``stop``, ``length``, ``cancelled``, ``timeout`` or ``error``
    (with ``message``)."""

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
    deadline: float | None = None  # the engine's clock() after which it ends the request ("timeout")
    seq: Generation = field(init=False)
    _cancel: threading.Event = field(init=False, default_factory=threading.Event)

    def __post_init__(self):
        self.seq = Generation(self.prompt, self.params, self.stop, self.logprobs, self.prompt_logprobs)

    @property
    def tokens(self) -> list[int]:
        """The tokens generated so far."""
        return self.seq.tokens

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def cancel(self) -> None:
        """Ask the engine to drop this request (its slot is freed at the next step)."""
        self._cancel.set()

    def wait_cancelled(self, timeout: float | None = None) -> bool:
        """Block until someone cancels the request (tests); whether it was."""
        return self._cancel.wait(timeout)


class EngineClosed(RuntimeError):
    """The engine is shutting down and takes no new requests."""


class QueueFull(RuntimeError):
    """The queue holds ``max_queue`` requests already."""


class Engine:
    """Owns ``model`` on a background thread and serves ``Request``s by continuous batching.

    A request ends when it produces one of the ``eos_id`` tokens (one id or several, e.g. a chat
    model's end of turn), meets its ``stop`` test, uses up its budget, is cancelled or passes its
    deadline (``request_timeout`` seconds after ``submit`` by ``clock``, if set). ``graphs`` picks the
    decode step (``stemlm.inference.core``)."""

    def __init__(self, model, eos_id: int | Sequence[int] | None = None, max_batch: int = 16, store=None,
                 metrics: Metrics | None = None, max_queue: int | None = None, request_timeout: float | None = None,
                 graphs: str = "auto", clock: Callable[[], float] = time.monotonic):
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        eos = [] if eos_id is None else [eos_id] if isinstance(eos_id, int) else list(eos_id)
        self.model, self.eos_ids, self.max_batch = model, frozenset(eos), max_batch
        self.max_queue, self.request_timeout, self.clock = max_queue, request_timeout, clock
        self.store, self.metrics = store, metrics or Metrics()
        self._core_args = (model, eos, eos[0] if eos else 0, store, max_batch, None, graphs)
        self.core = DecodeCore(*self._core_args)
        self.running: list[Request] = []  # in batch row order
        self._owner: dict[int, Request] = {}  # id(request.seq) -> request, for every admitted request
        self._waiting: deque[Request] = deque()
        self._admitting = 0  # taken from the queue, not yet published in ``running``
        self._cond = threading.Condition()
        self._calls: deque[tuple[Callable[[], object], Future]] = deque()  # ``call``s waiting for an idle engine
        self._closing = False
        self._thread: threading.Thread | None = None
        self._stopped = threading.Event()  # the loop has returned
        self._waker: Callable[[], object] | None = None  # run_async's wake-up

    # -- the public face ------------------------------------------------------------------------
    def start(self) -> Engine:
        """Start the engine thread (once; nothing if ``run_async`` owns the engine already).

        The loop is faster on the thread that loaded the model (``run_async`` there: one OpenMP team in the
        process, ``stemlm.runtime.threads``); a thread of its own is what tests and embedding callers get."""
        with self._cond:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="stemlm-engine", daemon=True)
                self._thread.start()
        return self

    def call(self, fn: Callable[[], object]) -> object:
        """Run ``fn()`` on the engine's thread while no request is running or waiting, and return its result
        (its exception is raised here): work on the engine's model without a second OpenMP team (benchmarks
        compare generation outside the engine this way). Under ``run_async`` the event loop, and so HTTP, waits
        for it too."""
        if self._thread is None or self._thread is threading.current_thread():
            return fn()
        done = Future()
        with self._cond:
            if self._closing:
                raise EngineClosed("the server is shutting down")
            self._calls.append((fn, done))
            self._cond.notify_all()
            self._wake()
        return done.result()

    def submit(self, *reqs: Request) -> None:
        """Queue ``reqs`` (all or none): ``EngineClosed`` once shutdown has begun, ``QueueFull`` when they
        do not fit ``max_queue``."""
        with self._cond:
            if self._closing:
                raise EngineClosed("the server is shutting down")
            if self.max_queue is not None and len(self._waiting) + len(reqs) > self.max_queue:
                raise QueueFull(f"the queue is full ({len(self._waiting)} of {self.max_queue} requests waiting)")
            if self.request_timeout is not None:
                for req in reqs:
                    req.deadline = self.clock() + self.request_timeout
            self._waiting.extend(reqs)
            self.metrics.queued(len(reqs))
            self._cond.notify_all()
            self._wake()

    def counts(self) -> dict:
        """Requests running and waiting right now."""
        with self._cond:
            return {"requests_running": len(self.running), "requests_queued": len(self._waiting)}

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until no request runs or waits; whether that happened within ``timeout`` seconds."""
        with self._cond:
            return self._cond.wait_for(self._idle, timeout)

    def _idle(self) -> bool:
        return not self.running and not self._waiting and not self._admitting

    def shutdown(self, drain: bool = True, timeout: float | None = None) -> None:
        """Refuse new requests, finish (``drain``) or cancel the others, and stop the thread."""
        with self._cond:
            self._closing = True
            if not drain:
                for req in [*self._waiting, *self.running]:
                    req.cancel()
            self._cond.notify_all()
            self._wake()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._stopped.wait(timeout)  # not join(): a loop run_async runs ends before its thread does

    # -- the engine thread ----------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._loop()
        finally:
            self._stopped.set()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._has_work():
                    self._cond.wait()
            if not self._turn():
                return

    def run_async(self) -> Awaitable[None]:
        """The engine loop as a coroutine of the running event loop, for the loop's thread, which it claims now
        (await it, or schedule it as a task; ``run_served`` does so beside uvicorn): HTTP's work then happens
        between decode steps on the one thread, with no second thread taking the interpreter lock or a core from
        a step and no wake-ups handed across threads. After each step the loop's ready work runs to
        quiescence (requests parsed and submitted, answers written) before the next step; an idle engine awaits
        its next request. It returns after ``shutdown`` once the work is done; ``submit``, ``call`` and
        ``shutdown`` work from any thread."""
        loop = asyncio.get_running_loop()
        wake = asyncio.Event()
        here = threading.get_ident()
        with self._cond:
            if self._thread is not None:
                raise RuntimeError("the engine runs on another thread already")
            self._thread = threading.current_thread()
            self._waker = lambda: wake.set() if threading.get_ident() == here else loop.call_soon_threadsafe(wake.set)
        return self._run_async(loop, wake)

    async def _run_async(self, loop: asyncio.AbstractEventLoop, wake: asyncio.Event) -> None:
        try:
            while True:
                with self._cond:
                    idle = not self._has_work()
                    if idle:
                        wake.clear()
                if idle:
                    await wake.wait()
                    await _let_io_run(loop)  # requests already in the sockets join the first one's group
                    continue
                if not self._turn():
                    return
                await _let_io_run(loop)
        finally:
            self._stopped.set()

    def _has_work(self) -> bool:
        return bool(self._waiting or self.running or self._closing or self._calls)

    def _wake(self) -> None:
        """Wake a loop waiting in ``run_async`` (under ``_cond``, after a change ``_has_work`` reads)."""
        if self._waker is not None:
            self._waker()

    def _turn(self) -> bool:
        """One turn of the loop: a waiting ``call``, or drop the ended, admit newcomers and step; False once
        the engine is closing and has nothing left to run."""
        with self._cond:
            call = self._calls.popleft() if self._calls and not self._waiting and not self.running else None
            if call is None and self._closing and not self._waiting and not self.running:
                return False
            room = self.max_batch - len(self.running)
            newcomers = [] if call else [self._waiting.popleft() for _ in range(min(room, len(self._waiting)))]
            self._admitting = len(newcomers)
            self.metrics.queued(-len(newcomers))
        if call is not None:
            _run_call(*call)
            return True
        try:
            self._drop_ended()
            joining = self._admissible(newcomers) if newcomers else []
            if joining:
                merged = self.core.merges()
                self.metrics.prefilled(merged)
                if not merged:  # nothing running (or a static step): a prefill forward of its own
                    self._deliver(self.core.add(joining))
                    self._publish()
                    joining = []
            if self.core.running or joining:
                self.metrics.stepped(len(self.core.running))
                self._deliver(self.core.step(joining))  # newcomers prefilled in the step's own forward
        except Exception as e:  # a failed forward must not kill the server: fail the requests involved
            log.exception("engine step failed")
            self.core = DecodeCore(*self._core_args)  # a fresh batch before anyone hears of the failure
            for req in list(self._owner.values()):  # every request the engine still owns
                self._finish(req, "error", f"{type(e).__name__}: {e}")
        self._publish()
        return True

    def _publish(self) -> None:
        """Show the batch's requests to other threads (``counts``, ``wait_idle``, ``shutdown``)."""
        with self._cond:
            self.running = [self._owner[id(s)] for s in self.core.running]
            self._admitting = 0
            if self._idle():
                self._cond.notify_all()  # wake wait_idle

    def _admissible(self, newcomers: list[Request]) -> list[Generation]:
        """The newcomers' sequences, less those cancelled or timed out while they waited."""
        seqs = []
        for req in newcomers:
            reason = self._ended(req, self.clock())
            if reason is not None:
                self._finish(req, reason)
                continue
            self._owner[id(req.seq)] = req
            seqs.append(req.seq)
        if seqs:
            self.metrics.admitted(len(seqs), sum(len(s.prompt) for s in seqs))
        return seqs

    def _drop_ended(self) -> None:
        """Take cancelled and timed-out requests out of the batch before the next forward."""
        now = self.clock()
        ended = [(s, r) for s in self.core.running if (r := self._ended(self._owner[id(s)], now)) is not None]
        if ended:
            self.core.drop([s for s, _ in ended])
            for s, reason in ended:
                self._finish(self._owner[id(s)], reason)

    @staticmethod
    def _ended(req: Request, now: float) -> str | None:
        if req.cancelled:
            return "cancelled"
        if req.deadline is not None and now > req.deadline:
            return "timeout"
        return None

    def _deliver(self, progress) -> None:
        """Hand out what the core did: prompt logprobs, one token each, the finishes."""
        for s in progress.emitted:
            req = self._owner[id(s)]
            if s.prompt_entries is not None and len(s.tokens) == 1:
                _send(req, PromptLogprobs(s.prompt_entries))
            lp, top = s.token_logprobs[-1] if s.logprobs is not None else (None, None)
            _send(req, Token(s.tokens[-1], lp, top))
        for s in progress.finished:
            req = self._owner[id(s)]
            if s.prompt_entries is not None and not s.tokens:
                _send(req, PromptLogprobs(s.prompt_entries))
            self._finish(req, s.finish_reason)
        self.metrics.generated(len(progress.emitted))

    def _finish(self, req: Request, reason: str, message: str = "") -> None:
        self._owner.pop(id(req.seq), None)
        self.metrics.finished(reason)
        with self._cond:  # out of the published batch before its caller hears: counts agree with the answers
            self.running = [r for r in self.running if r is not req]
        _send(req, Finished(reason, message))


def _run_call(fn: Callable[[], object], done: Future) -> None:
    """``Engine.call``'s work, its result or exception handed to the waiting caller."""
    if done.set_running_or_notify_cancel():
        try:
            done.set_result(fn())
        except BaseException as e:  # raised in the caller's thread
            done.set_exception(e)


def _send(req: Request, event) -> None:
    """Hand ``event`` to the request's sink; a sink that fails cancels its own request, no other."""
    try:
        req.sink(event)
    except Exception:
        log.exception("a request's event sink failed; the request is dropped")
        req.cancel()


async def _let_io_run(loop: asyncio.AbstractEventLoop, most: int = 256) -> None:
    """Yield to ``loop`` until its ready callbacks are done (at most ``most`` rounds): each round polls the
    sockets and runs what is ready, so a request that arrived during a step is parsed, routed and submitted
    before the next one. A loop without asyncio's ``_ready`` queue (e.g. uvloop) gets a few rounds."""
    ready = getattr(loop, "_ready", None)
    for _ in range(most if ready is not None else 8):
        await asyncio.sleep(0)
        if ready is not None and not ready:
            return
