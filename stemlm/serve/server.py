"""Building what the server serves from a checkpoint, and running it with uvicorn (blocking or in a thread)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import threading
from pathlib import Path

from ..data.codec import load_codec
from ..checkpoint.directory import read_config_extras, resolve_checkpoint
from ..store import Placement, open_model
from .app import Served, create_app
from .chat import ChatTemplate, find_chat_template
from .engine import Engine
from .guard import Limits


def load_served(ckpt: str | os.PathLike, placement: Placement | str | None = None, max_batch: int = 16,
                model_name: str | None = None, chat_template: str | os.PathLike | None = None,
                tokenizer: str | os.PathLike | None = None, verify: bool = True, limits: Limits | None = None,
                graphs: str = "auto") -> Served:
    """Open a checkpoint (or a run's newest one) with its tables placed (``stemlm.store.Placement`` or a tier
    name; default: in memory on the CPU) into an engine, not yet started.

    The served name defaults to the checkpoint's directory name (the run's, for a run directory);
    ``limits`` bounds what one client may ask (``guard.Limits``; default: no API key, 1 MiB bodies, a
    queue of 256); ``graphs`` picks the decode step (``stemlm.inference.core``).
    """
    given = Path(ckpt)
    ckpt = resolve_checkpoint(ckpt, verify)
    codec = load_codec(ckpt, tokenizer)
    template = find_chat_template(ckpt, codec, chat_template)
    chat = None
    if template is not None:
        eos = "" if codec.eos_id is None else codec.decode([codec.eos_id], skip_special=False)
        chat = ChatTemplate(template, eos_token=eos)
    model = open_model(ckpt, placement, verify=verify)
    store = model.tables
    limits = limits or Limits()
    engine = Engine(model, eos_id=_end_ids(ckpt, codec), max_batch=max_batch, store=store, max_queue=limits.max_queue,
                    request_timeout=limits.request_timeout, graphs=graphs)
    return Served(engine, codec, model_name or given.resolve().name, chat, store, limits)


def _end_ids(ckpt: Path, codec) -> list[int]:
    """Tokens that end a request: the tokenizer's end of text and a converted model's ``eos_token_id``
    (e.g. SmolLM2-Instruct's end of turn ``<|im_end|>``, which its tokenizer.json does not mark)."""
    eos = read_config_extras(ckpt).get("eos_token_id")
    ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    return list(dict.fromkeys(([codec.eos_id] if codec.eos_id is not None else []) + ids))


def uvicorn_server(served: Served, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info",
                   loop: str = "auto", http: str = "auto"):
    """A ``uvicorn.Server`` for the app (``.run()`` blocks, handling SIGINT/SIGTERM by draining).

    ``loop``/``http``: uvicorn's event loop and HTTP parser; ``auto`` takes uvloop and httptools when
    they are installed (not by stemlm: no gain measured, docs/serving.md), else asyncio and h11."""
    import uvicorn

    config = uvicorn.Config(create_app(served), host=host, port=port, log_level=log_level, timeout_graceful_shutdown=None,
                            loop=loop, http=http)
    return uvicorn.Server(config)


def serve_forever(served: Served, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> None:
    """Serve until SIGINT/SIGTERM (main thread): in-flight requests finish, the engine drains, the table
    store closes, and the call returns. A second signal stops at once (uvicorn's forced exit).

    The engine and HTTP share this thread, the one that loaded the model (``run_served``): one OpenMP team
    in the process (``stemlm.runtime.threads``), which keeps decode steps at their speed, and HTTP's work
    done between steps."""
    server = uvicorn_server(served, host, port, log_level)
    signals = []

    def stop(sig, frame):
        signals.append(sig)
        server.should_exit = True
        server.force_exit = len(signals) > 1

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:  # returns once HTTP has stopped and the engine is drained; uvicorn's exit (e.g. a taken port) is raised
        run_served(served, server)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if served.store is not None:
            served.store.close()


def run_served(served: Served, server, alongside=None, name: str = "stemlm-alongside") -> None:
    """Run ``server`` (``uvicorn_server``) and the engine on the calling thread, in one event loop: the engine is
    a task of the loop (``Engine.run_async``), and the HTTP layer's work runs between its decode steps.
    Signals are left to the caller (uvicorn installs none). ``alongside`` (e.g. a benchmark's clients) runs on
    a thread of its own once the server accepts connections; when it returns or raises, the server stops
    (in-flight requests finish, the engine drains), and its exception is raised here."""
    server.capture_signals = contextlib.nullcontext  # the caller owns the signals (uvicorn would re-raise them)
    failed: list[BaseException] = []

    def side():
        try:
            while not server.started and not server.should_exit:
                threading.Event().wait(0.01)
            if server.started:
                alongside()
        except BaseException as e:  # re-raised on the calling thread
            failed.append(e)
        finally:
            server.should_exit = True

    async def main():
        engine = asyncio.ensure_future(served.engine.run_async())  # claims the engine for this thread now
        try:
            if alongside is not None:
                threading.Thread(target=side, name=name, daemon=True).start()
            await server.serve()
        finally:
            server.should_exit = True  # (a failed startup) the thread alongside stops waiting for it
            served.engine.shutdown(drain=True)  # the lifespan drained it already, unless startup failed
            await engine

    factory = server.config.get_loop_factory() or asyncio.new_event_loop  # uvicorn's choice of loop
    loop = factory()
    try:
        loop.run_until_complete(main())
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()
    if failed:
        raise failed[0]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ServerThread:
    """The server on a background thread (tests, benchmarks): ``with ServerThread(served) as url: ...``.

    Leaving the block shuts it down as SIGTERM would: in-flight requests finish first."""

    def __init__(self, served: Served, host: str = "127.0.0.1", port: int | None = None, log_level: str = "warning",
                 **uvicorn_kw):
        self.host, self.port = host, port or free_port(host)
        self.server = uvicorn_server(served, host, self.port, log_level, **uvicorn_kw)
        self.thread = threading.Thread(target=self.server.run, name="stemlm-http", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> str:
        """Start serving; the base URL once the server accepts connections."""
        self.thread.start()
        deadline = threading.Event()
        for _ in range(int(timeout / 0.02)):
            if self.server.started:
                return self.url
            if not self.thread.is_alive():
                break
            deadline.wait(0.02)
        raise RuntimeError(f"the server did not start on {self.url}")

    def stop(self, timeout: float = 60.0) -> None:
        """Graceful shutdown: stop accepting, let in-flight requests finish, drain the engine."""
        self.server.should_exit = True
        self.thread.join(timeout)

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
