"""What keeps an exposed server's work bounded: the API key, the body size, the limits of one request.

``Limits`` holds every bound (``stemlm serve --api-key``, ``--max-body-bytes``, ``--max-prompt-tokens``,
``--max-new-tokens``, ``--max-queue``, ``--request-timeout``). ``Guard`` wraps the ASGI app: a request
without the key gets a ``401`` (``/health`` stays open, as in vLLM), a body over the limit a ``413``
before the app sees it (``Content-Length`` is checked first; a chunked body is counted as it
arrives). The per-request bounds are checked by the handlers (``check_prompt_limit``,
``check_new_tokens_limit``); a full queue is the engine's ``QueueFull`` (a ``429``) and a deadline
its ``timeout`` finish (a ``504``).
"""

from __future__ import annotations

import hmac
import json
from dataclasses import dataclass

from .api import ApiError

OPEN_PATHS = frozenset({"/health"})


@dataclass(frozen=True)
class Limits:
    """Bounds of an exposed server; ``None`` = no bound (``max_prompt_tokens``: the model's context)."""

    api_key: str | None = None
    max_body_bytes: int = 1 << 20
    max_prompt_tokens: int | None = None
    max_new_tokens: int | None = None
    max_queue: int | None = 256
    request_timeout: float | None = None

    def __post_init__(self):
        for name in ("max_body_bytes", "max_prompt_tokens", "max_new_tokens", "max_queue"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.request_timeout is not None and not self.request_timeout > 0:
            raise ValueError(f"request_timeout must be > 0 seconds, got {self.request_timeout}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty")


def check_prompt_limit(n_tokens: int, limits: Limits, param: str = "prompt") -> None:
    """A ``413`` for a prompt longer than ``limits.max_prompt_tokens``."""
    if limits.max_prompt_tokens is not None and n_tokens > limits.max_prompt_tokens:
        raise ApiError(413, f"the prompt has {n_tokens} tokens, more than this server's limit of "
                            f"{limits.max_prompt_tokens}", param, "prompt_too_long")


def check_new_tokens_limit(requested: int | None, limits: Limits, param: str = "max_tokens") -> None:
    """A ``413`` for a ``max_tokens`` above ``limits.max_new_tokens``."""
    if requested is not None and limits.max_new_tokens is not None and requested > limits.max_new_tokens:
        raise ApiError(413, f"{param}={requested} is more than this server's limit of {limits.max_new_tokens} "
                            "new tokens per request", param, "max_tokens_too_large")


class Guard:
    """``app`` behind the API key and the body-size limit (an ASGI middleware: ``app.add_middleware(Guard,
    limits=...)``)."""

    def __init__(self, app, limits: Limits):
        self.app, self.limits = app, limits

    async def __call__(self, scope, receive, send):
        limits = self.limits
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if limits.api_key is not None and scope["path"] not in OPEN_PATHS and not _authorized(scope, limits.api_key):
            return await _refuse(send, ApiError(401, "a valid API key is required: send 'Authorization: Bearer KEY'",
                                                code="invalid_api_key"), {"www-authenticate": "Bearer"})
        declared = _header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limits.max_body_bytes:
            return await _refuse(send, _too_large(limits))
        body = await _read_body(receive, limits.max_body_bytes)
        if body is None:
            return await _refuse(send, _too_large(limits))
        return await self.app(scope, _replay(body, receive), send)


def _too_large(limits: Limits) -> ApiError:
    return ApiError(413, f"the request body is larger than this server's limit of {limits.max_body_bytes} bytes",
                    code="body_too_large")


def _header(scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


def _authorized(scope, key: str) -> bool:
    given = _header(scope, b"authorization") or ""
    scheme, _, token = given.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())


async def _read_body(receive, limit: int) -> bytes | None:
    """The whole body, or ``None`` as soon as it passes ``limit`` bytes."""
    parts, size = [], 0
    while True:
        message = await receive()
        if message["type"] != "http.request":  # the client left: let the app see it
            return b"".join(parts)
        parts.append(message.get("body", b""))
        size += len(parts[-1])
        if size > limit:
            return None
        if not message.get("more_body", False):
            return b"".join(parts)


def _replay(body: bytes, receive):
    """A ``receive`` that hands out ``body`` once, then waits on the real one (for the disconnect)."""
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


async def _refuse(send, error: ApiError, headers: dict | None = None) -> None:
    payload = json.dumps(error.body()).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    raw += [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": error.status, "headers": raw})
    await send({"type": "http.response.body", "body": payload})
