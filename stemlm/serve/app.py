"""The FastAPI layer: OpenAI endpoints over the engine, streamed by server-sent events.

Handlers check a request (4xx in OpenAI's error shape) and submit one engine ``Request`` per prompt.
A streaming handler reads its events from an ``asyncio.Queue`` that the engine fills through
``loop.call_soon`` when it runs on the event loop's own thread (``Engine.run_async``, as ``stemlm serve``
runs it), else through ``loop.call_soon_threadsafe``; a non-streaming one is woken once, when its request
ends (the engine appends the events to a deque and sets an ``asyncio.Event`` at the end), so a token
costs the event loop nothing. A client that disconnects cancels its requests (a non-streaming handler
waits for its requests' end and for the client's disconnect message at once), and the engine drops
them at its next step. ``guard.Guard`` checks the API key and the body size before a handler runs;
the handlers check the prompt and ``max_tokens`` limits, a full queue is a ``429`` and a request past
its deadline a ``504``. The lifespan starts the engine and, at shutdown (after uvicorn has let
in-flight requests finish), drains it.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections import deque
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import APIRouter, FastAPI, Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException

from ..inference.text import TextStream
from . import api, responses
from .api import ApiError
from .chat import ChatTemplate
from .engine import Engine, EngineClosed, Finished, QueueFull, Request
from .guard import Guard, Limits, check_new_tokens_limit, check_prompt_limit
from .responses import Outcome

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the rest of the context


@dataclass
class Served:
    """What the server serves: the engine (owning the model), its tokenizer, name and chat template."""

    engine: Engine
    codec: object
    name: str
    chat: ChatTemplate | None = None
    store: object = None
    limits: Limits = Limits()

    @property
    def context(self) -> int:
        return self.engine.model.cfg.max_seq_len

    @property
    def vocab_size(self) -> int:
        return self.engine.model.cfg.vocab_size


class _Job:
    """One prompt in the engine and how its events reach the handler: each one through an
    ``asyncio.Queue`` (``stream``), or all at once when the request ends."""

    def __init__(self, served: Served, prompt: list[int], params, stops: list[str], logprobs=None, prompt_logprobs=None,
                 stream: bool = False):
        codec = served.codec
        self.loop, self.stream = asyncio.get_running_loop(), stream
        self.thread = threading.get_ident()  # the event loop's: an engine running on it hands events over directly
        self.queue, self.events, self.ended = asyncio.Queue(), deque(), asyncio.Event()
        self.outcome = Outcome(prompt, TextStream(codec, stops))
        stop = (lambda toks: any(s in codec.decode(toks) for s in stops)) if stops else None
        self.req = Request(prompt, params, self._deliver, stop, logprobs, prompt_logprobs)

    def _deliver(self, event) -> None:
        """Called by the engine: hand ``event`` to the handler's event loop (at the end, unless streaming)."""
        try:
            call = self.loop.call_soon if threading.get_ident() == self.thread else self.loop.call_soon_threadsafe
            if self.stream:
                call(self.queue.put_nowait, event)
                return
            self.events.append(event)
            if isinstance(event, Finished):
                call(self.ended.set)
        except RuntimeError:  # the event loop is closed (forced exit): nobody listens any more
            self.req.cancel()

    def take_events(self) -> None:
        """Record the events a non-streaming job has received so far."""
        events = []
        while self.events:
            events.append(self.events.popleft())
        self.outcome.add_all(events)

    async def next_piece(self) -> str:
        """Wait for the next event and record it; the text it makes showable."""
        return self.outcome.add(await self.queue.get())

    @property
    def done(self) -> bool:
        return self.outcome.finished is not None


def _submit(served: Served, jobs: list[_Job]) -> list[_Job]:
    try:
        served.engine.submit(*(job.req for job in jobs))
    except EngineClosed as e:
        raise ApiError(503, str(e), type="server_error", code="shutting_down") from None
    except QueueFull as e:
        raise ApiError(429, f"{e}; retry later", type="server_error", code="queue_full") from None
    return jobs


def _cancel(jobs: list[_Job]) -> None:
    for job in jobs:
        if not job.done:
            job.req.cancel()


async def _collect(http: HttpRequest, jobs: list[_Job]) -> None:
    """Wait until every (non-streaming) job has finished or the client has gone away (then cancel them)."""
    async def all_ended():
        for job in jobs:
            await job.ended.wait()

    ended, gone = asyncio.ensure_future(all_ended()), asyncio.ensure_future(_disconnected(http))
    try:
        await asyncio.wait({ended, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not ended.done():
            return
        for job in jobs:
            job.take_events()
    finally:
        for task in (ended, gone):
            task.cancel()
        _cancel(jobs)
    for job in jobs:
        _raise_failure(job.outcome.finished)


async def _disconnected(http: HttpRequest) -> None:
    """Return when the client disconnects (the body has been read: the next message is the disconnect)."""
    while (await http.receive())["type"] != "http.disconnect":
        pass


def _raise_failure(finished: Finished) -> None:
    """The error a request that failed or ran out of time answers with (none for the others)."""
    if finished.reason == "error":
        raise ApiError(500, f"generation failed: {finished.message}", type="server_error")
    if finished.reason == "timeout":
        raise ApiError(504, "the request ran longer than this server's --request-timeout", type="server_error",
                       code="timeout")


def _sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def _stream(jobs: list[_Job], first: list[str], chunk, final, usage_chunk, opening: dict | None = None) -> StreamingResponse:
    """Server-sent events: ``opening``, then per job its ``first`` piece, its text pieces as they come and
    its finish; the usage chunk (if any) and ``[DONE]``."""
    async def events():
        try:
            if opening is not None:
                yield _sse(opening)
            for i, job in enumerate(jobs):
                if first[i]:
                    yield _sse(chunk(i, first[i]))
                while not job.done:
                    piece = await job.next_piece()
                    if piece:
                        yield _sse(chunk(i, piece))
                try:  # the status line is long gone: a failure is an error event, then the end
                    _raise_failure(job.outcome.finished)
                except ApiError as e:
                    yield _sse(e.body())
                    break
                yield _sse(final(i, job.outcome.finish_reason))
            if usage_chunk is not None:
                yield _sse(usage_chunk())
            yield "data: [DONE]\n\n"
        finally:  # also when the client disconnects mid-stream
            _cancel(jobs)

    return StreamingResponse(events(), media_type="text/event-stream")


def create_app(served: Served) -> FastAPI:
    """The FastAPI application serving ``served`` (the routes below read it from ``app.state``)."""
    app = FastAPI(title="stemlm", lifespan=_lifespan)
    app.state.served = served
    app.add_middleware(Guard, limits=served.limits)
    _add_error_handlers(app)
    app.include_router(router)
    return app


@asynccontextmanager
async def _lifespan(app: FastAPI):
    """Start the engine; at shutdown (after uvicorn has let in-flight requests finish) drain it."""
    served = app.state.served
    served.engine.start()
    yield
    await asyncio.to_thread(served.engine.shutdown, True)


router = APIRouter()


def _served(http: HttpRequest) -> Served:
    return http.app.state.served


@router.get("/health")
async def health():
    return {"status": "ok"}


@router.get("/v1/models")
async def models(http: HttpRequest):
    served = _served(http)
    return {"object": "list", "data": [{"id": served.name, "object": "model", "created": 0, "owned_by": "stemlm",
                                        "max_model_len": served.context}]}


@router.get("/metrics")
async def metrics(http: HttpRequest):
    served = _served(http)
    counts = served.engine.counts()
    store = served.store.stats() if served.store is not None else None
    return {**served.engine.metrics.snapshot(), **counts, "queue_length": counts["requests_queued"],
            "max_batch": served.engine.max_batch,
            "table_store": None if store is None else {k: v for k, v in store.items() if k != "per_table"}}


@router.get("/tokenizer_info")
async def tokenizer_info(http: HttpRequest):
    served = _served(http)
    codec, eos = served.codec, served.codec.eos_id
    return {"eos_token": None if eos is None else responses.token_text(codec, eos), "bos_token": None,
            "pad_token": None, "model_max_length": served.context,
            "chat_template": served.chat.source if served.chat else None}


@router.post("/tokenize")
async def tokenize(body: api.TokenizeRequest, http: HttpRequest):
    served = _served(http)
    ids = served.codec.encode(body.prompt, special=body.add_special_tokens)
    return {"tokens": ids, "count": len(ids), "max_model_len": served.context}


@router.post("/detokenize")
async def detokenize(body: api.DetokenizeRequest, http: HttpRequest):
    served = _served(http)
    api.check_prompt(body.tokens or [0], served.vocab_size, max(served.context, len(body.tokens)), "tokens")
    return {"prompt": served.codec.decode(body.tokens)}


@router.post("/v1/completions")
async def completions(body: api.CompletionRequest, http: HttpRequest):
    served = _served(http)
    codec, limits = served.codec, served.limits
    api.check_common(body, served.name)
    prompts = api.completion_prompts(body, codec)
    if not prompts:
        raise ApiError(400, "the prompt list is empty", "prompt")
    check_new_tokens_limit(body.max_tokens, limits)
    asks = []
    for ids in prompts:
        check_prompt_limit(len(ids), limits)
        api.check_prompt(ids, served.vocab_size, served.context)
        n = api.max_new_tokens(body.max_tokens, len(ids), served.context, _capped(COMPLETIONS_DEFAULT_MAX_TOKENS, limits))
        asks.append((ids, api.sampling(body, n)))
    k = body.logprobs
    jobs = _submit(served, [_Job(served, ids, sp, body.stops(), k, k if body.echo else None, bool(body.stream))
                            for ids, sp in asks])
    rid, name = responses.new_id("cmpl"), served.name
    usage = (lambda: responses.usage_chunk(rid, name, "text_completion", [j.outcome for j in jobs])) \
        if body.stream_options and body.stream_options.include_usage else None
    shape = _StreamShape([codec.decode(j.outcome.prompt) if body.echo else "" for j in jobs],
                         lambda i, text: responses.completion_chunk(rid, name, i, text),
                         lambda i, reason: responses.completion_chunk(rid, name, i, "", reason), usage)
    return await _answer(http, jobs, bool(body.stream), shape,
                         lambda: responses.completion_body(rid, name, codec, [j.outcome for j in jobs], body.echo,
                                                           k is not None))


@router.post("/v1/chat/completions")
async def chat_completions(body: api.ChatRequest, http: HttpRequest):
    served = _served(http)
    codec, limits = served.codec, served.limits
    api.check_common(body, served.name)
    if served.chat is None:
        raise ApiError(400, f"model {served.name!r} has no chat template; use /v1/completions, or start the "
                            "server with --chat-template FILE", "messages", "no_chat_template")
    text = served.chat.render([{"role": m.role, "content": m.text()} for m in body.messages])
    ids = codec.encode(text, special=True)
    check_prompt_limit(len(ids), limits, "messages")
    api.check_prompt(ids, served.vocab_size, served.context, "messages")
    requested, param = (body.max_completion_tokens, "max_completion_tokens") \
        if body.max_completion_tokens is not None else (body.max_tokens, "max_tokens")
    check_new_tokens_limit(requested, limits, param)
    n = api.max_new_tokens(requested, len(ids), served.context, _capped(None, limits), param)
    k = (body.top_logprobs or 0) if body.logprobs else None
    jobs = _submit(served, [_Job(served, ids, api.sampling(body, n), body.stops(), k, stream=bool(body.stream))])
    rid, name = responses.new_id("chatcmpl"), served.name
    usage = (lambda: responses.usage_chunk(rid, name, "chat.completion.chunk", [jobs[0].outcome])) \
        if body.stream_options and body.stream_options.include_usage else None
    shape = _StreamShape([""], lambda i, text: responses.chat_chunk(rid, name, {"content": text}),
                         lambda i, reason: responses.chat_chunk(rid, name, {}, reason), usage,
                         opening=responses.chat_chunk(rid, name, {"role": "assistant", "content": ""}))
    return await _answer(http, jobs, bool(body.stream), shape,
                         lambda: responses.chat_body(rid, name, codec, jobs[0].outcome, k is not None))


@dataclass
class _StreamShape:
    """How a streamed answer is built: each job's ``first`` piece, a text ``chunk(i, text)``, the
    ``final(i, reason)`` chunk, an optional ``usage`` chunk and an ``opening`` event."""

    first: list[str]
    chunk: object
    final: object
    usage: object = None
    opening: dict | None = None


async def _answer(http: HttpRequest, jobs: list[_Job], streaming: bool, shape: _StreamShape, body):
    """The one job runner of completions and chat: stream the jobs' events as they come, or wait for
    every job's end (or the client's disconnect) and answer with ``body()``."""
    if streaming:
        return _stream(jobs, shape.first, shape.chunk, shape.final, shape.usage, shape.opening)
    await _collect(http, jobs)
    return JSONResponse(body())  # a Response passes FastAPI untouched: no jsonable_encoder walk of the body


def _capped(default: int | None, limits: Limits) -> int | None:
    """The default number of new tokens under the server's limit (``None``: the rest of the context)."""
    if limits.max_new_tokens is None:
        return default
    return limits.max_new_tokens if default is None else min(default, limits.max_new_tokens)


def _add_error_handlers(app: FastAPI) -> None:
    """Every error leaves as ``{"error": {...}}``: bad JSON and schema violations as 400."""
    @app.exception_handler(ApiError)
    async def api_error(request, exc: ApiError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(request, exc: RequestValidationError):
        err = (exc.errors() or [{}])[0]
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        if err.get("type") == "json_invalid":
            msg, loc = f"the request body is not valid JSON: {err.get('ctx', {}).get('error', err.get('msg'))}", []
        else:
            msg = f"{'.'.join(loc) or 'body'}: {err.get('msg', 'invalid value')}"
        return JSONResponse(ApiError(400, msg, ".".join(loc) or None).body(), status_code=400)

    @app.exception_handler(HTTPException)
    async def http_error(request, exc: HTTPException):
        code = "not_found" if exc.status_code == 404 else None
        return JSONResponse(ApiError(exc.status_code, str(exc.detail), code=code).body(), status_code=exc.status_code)
