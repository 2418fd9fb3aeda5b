"""OpenAI request schemas and their checks: what a request may ask and the 4xx error for what it may not.

The schemas follow OpenAI's ``/v1/completions`` and ``/v1/chat/completions``; ``top_k`` is an
extension. Unknown fields are ignored (clients send options this server has no use for); ``n``
and ``best_of`` other than 1 are refused. ``prepare_prompts`` turns a request into token id lists
checked against the model's vocabulary and context, and ``sampling`` into ``SamplingParams``.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from ..inference.sampling import SamplingParams

MAX_LOGPROBS = 20


class ApiError(Exception):
    """A request the server refuses: HTTP ``status`` and OpenAI's error body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type

    def body(self) -> dict:
        """``{"error": {"message", "type", "param", "code"}}``."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    """``include_usage``: a last chunk carries the usage."""

    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=())

    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None

    def stops(self) -> list[str]:
        """The stop strings as a list."""
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class CompletionRequest(_Common):
    """``POST /v1/completions``: ``prompt`` is text, texts, token ids or lists of token ids."""

    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: int | None = None


class ChatMessage(BaseModel):
    """One message; ``content`` is text or a list of ``{"type": "text", "text": ...}`` parts."""

    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict] | None = None

    def text(self) -> str:
        """The content as text (a ``400`` for parts that are not text)."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ApiError(400, f"only text content parts are supported, got type {part.get('type')!r}",
                               "messages")
            parts.append(part["text"])
        return "".join(parts)


class ChatRequest(_Common):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)


class TokenizeRequest(BaseModel):
    """``POST /tokenize`` (as vLLM's): text to token ids."""

    prompt: str
    add_special_tokens: bool = True


class DetokenizeRequest(BaseModel):
    """``POST /detokenize``: token ids to text."""

    tokens: list[int]


def check_common(req: _Common, served_name: str) -> None:
    """The checks shared by both endpoints: the model's name, ``n``, sampling settings."""
    if req.model is not None and req.model != served_name:
        raise ApiError(404, f"model {req.model!r} does not exist; this server serves {served_name!r}", "model",
                       "model_not_found")
    if req.n != 1:
        raise ApiError(400, f"n={req.n} is not supported: this server returns one choice per prompt (n=1)", "n")
    if getattr(req, "best_of", None) not in (None, 1):
        raise ApiError(400, "best_of other than 1 is not supported", "best_of")
    for name, ok, what in (("temperature", req.temperature >= 0 and req.temperature != float("inf"), "a finite number >= 0"),
                           ("top_p", req.top_p is None or 0 < req.top_p <= 1, "in (0, 1]"),
                           ("top_k", req.top_k is None or req.top_k >= -1, ">= 1 (or -1/0 for no limit)")):
        if not ok:
            raise ApiError(400, f"{name} must be {what}, got {getattr(req, name)}", name)


def sampling(req: _Common, max_tokens: int) -> SamplingParams:
    """The request's ``SamplingParams`` (``top_k`` of 0 or -1 means no limit, as in vLLM)."""
    top_k = req.top_k if req.top_k is not None and req.top_k > 0 else None
    return SamplingParams(max_tokens, req.temperature, top_k, req.top_p, req.seed)


def completion_prompts(req: CompletionRequest, codec) -> list[list[int]]:
    """The prompts of a completions request as token id lists (texts are encoded as prompts: with the
    tokenizer's leading special tokens, or stemlm's document start)."""
    p = req.prompt
    if isinstance(p, str):
        return [codec.encode(p, special=True)]
    if p and all(isinstance(x, int) for x in p):
        return [list(p)]
    return [codec.encode(x, special=True) if isinstance(x, str) else list(x) for x in p]


def check_prompt(ids: list[int], vocab_size: int, context: int, param: str = "prompt") -> None:
    """A ``400`` for an empty prompt, ids outside the vocabulary or a prompt longer than the context."""
    if not ids:
        raise ApiError(400, "the prompt is empty (it encodes to no tokens)", param)
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ApiError(400, f"token id {bad} is out of range for the model's vocabulary of {vocab_size}", param)
    if len(ids) > context:
        raise ApiError(400, f"the prompt has {len(ids)} tokens, more than the model's context of {context} tokens",
                       param, "context_length_exceeded")


def max_new_tokens(requested: int | None, prompt_len: int, context: int, default: int | None,
                   param: str = "max_tokens") -> int:
    """The number of tokens to generate: ``requested`` if it fits the context after the prompt (else a
    ``400`` naming the lengths), or ``default`` (``None``: the rest of the context) capped to fit."""
    room = context - prompt_len
    if requested is None:
        return room if default is None else min(default, room)
    if requested < 0:
        raise ApiError(400, f"{param} must be >= 0, got {requested}", param)
    if requested > room:
        raise ApiError(400, f"{param}={requested} is too large: the prompt has {prompt_len} tokens and the model's "
                            f"context is {context}, so at most {room} new tokens fit", param, "context_length_exceeded")
    return requested
