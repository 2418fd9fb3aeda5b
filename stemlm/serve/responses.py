"""OpenAI response bodies and stream chunks, built from what the engine produced for each prompt."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from ..inference.text import TextStream
from .engine import Finished, PromptLogprobs, Token


@dataclass
class Outcome:
    """Everything one prompt produced: its tokens (with logprobs if asked), text and finish reason."""

    prompt: list[int]
    text: TextStream
    tokens: list[Token] = field(default_factory=list)
    prompt_logprobs: PromptLogprobs | None = None
    finished: Finished | None = None

    def add(self, event) -> str:
        """Record an engine event; the text it makes showable (for streaming)."""
        if isinstance(event, Token):
            self.tokens.append(event)
            return self.text.push(event.id)
        if isinstance(event, PromptLogprobs):
            self.prompt_logprobs = event
        elif isinstance(event, Finished):
            self.finished = event
            return self.text.finish()
        return ""

    def add_all(self, events) -> None:
        """Record a finished request's events at once (its text decoded once, not token by token)."""
        tokens = [e for e in events if isinstance(e, Token)]
        self.tokens += tokens
        if tokens:
            self.text.push(*(t.id for t in tokens))
        for event in events:
            if not isinstance(event, Token):
                self.add(event)

    @property
    def finish_reason(self) -> str:
        """``stop`` (end of text or a stop string) or ``length``."""
        return "stop" if self.text.stopped or (self.finished and self.finished.reason == "stop") else "length"


def new_id(prefix: str) -> str:
    """A fresh response id such as ``cmpl-3f2a...``."""
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(outcomes: list[Outcome]) -> dict:
    """``prompt_tokens``, ``completion_tokens``, ``total_tokens`` over all prompts."""
    p = sum(len(o.prompt) for o in outcomes)
    c = sum(len(o.tokens) for o in outcomes)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def token_text(codec, tok: int) -> str:
    """One token's text, special tokens included (logprob entries name every token)."""
    return codec.decode([tok], skip_special=False)


def completion_logprobs(codec, o: Outcome, echo: bool, offset: int) -> dict:
    """OpenAI's legacy ``logprobs`` object (prompt entries first when ``echo``), offsets from ``offset``."""
    entries = list(o.prompt_logprobs.entries) if echo and o.prompt_logprobs else []
    ids = (list(o.prompt) if echo else []) + [t.id for t in o.tokens]
    entries += [(t.logprob, t.top) for t in o.tokens]
    tokens, offsets, top = [], [], []
    for tok, (_, alts) in zip(ids, entries):
        tokens.append(token_text(codec, tok))
        offsets.append(offset)
        offset += len(tokens[-1])
        top.append(None if alts is None else _top_dict(codec, alts))
    return {"tokens": tokens, "token_logprobs": [lp for lp, _ in entries], "top_logprobs": top,
            "text_offset": offsets}


def _top_dict(codec, alts: list[tuple[int, float]]) -> dict[str, float]:
    """``{token text: logprob}``; when two ids share a text, the larger logprob is kept."""
    out: dict[str, float] = {}
    for tok, lp in alts:
        key = token_text(codec, tok)
        out[key] = max(lp, out.get(key, float("-inf")))
    return out


def chat_logprobs(codec, o: Outcome) -> dict:
    """The chat ``logprobs`` object: one entry per generated token with its ``top_logprobs``."""
    def entry(tok: int, lp: float) -> dict:
        text = token_text(codec, tok)
        return {"token": text, "logprob": lp, "bytes": list(text.encode())}

    return {"content": [{**entry(t.id, t.logprob), "top_logprobs": [entry(i, lp) for i, lp in (t.top or [])]}
                        for t in o.tokens]}


def completion_body(rid: str, model: str, codec, outcomes: list[Outcome], echo: bool, logprobs: bool) -> dict:
    """The whole ``text_completion`` response."""
    choices = []
    for i, o in enumerate(outcomes):
        prompt_text = codec.decode(o.prompt) if echo else ""
        lp = completion_logprobs(codec, o, echo, 0) if logprobs else None
        choices.append({"index": i, "text": prompt_text + o.text.text, "logprobs": lp, "finish_reason": o.finish_reason})
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model, "choices": choices,
            "usage": usage(outcomes)}


def chat_body(rid: str, model: str, codec, o: Outcome, logprobs: bool) -> dict:
    """The whole ``chat.completion`` response."""
    choice = {"index": 0, "message": {"role": "assistant", "content": o.text.text},
              "logprobs": chat_logprobs(codec, o) if logprobs else None, "finish_reason": o.finish_reason}
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model, "choices": [choice],
            "usage": usage([o])}


def completion_chunk(rid: str, model: str, index: int, text: str, finish_reason: str | None = None) -> dict:
    """A ``text_completion`` stream chunk."""
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}]}


def chat_chunk(rid: str, model: str, delta: dict, finish_reason: str | None = None) -> dict:
    """A ``chat.completion.chunk``."""
    return {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]}


def usage_chunk(rid: str, model: str, obj: str, outcomes: list[Outcome]) -> dict:
    """The last chunk when ``stream_options.include_usage``: no choices, the usage."""
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": [], "usage": usage(outcomes)}
