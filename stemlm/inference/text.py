"""Text in, text out around ``generate``: prompts and streamed detokenization over a ``TextCodec``.

A checkpoint directory carries its tokenizer (``tokenizer.json`` from ``stemlm data``, a
SentencePiece ``tokenizer.model``, or Hugging Face tokenizer files), read by
``stemlm.data.codec.load_codec``. stemlm's own corpus starts every document with ``<|endoftext|>``,
so prompts get that token in front, as in training.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import torch

from ..data.codec import TextCodec


def encode_prompt(codec: TextCodec, text: str, vocab_size: int) -> torch.Tensor:
    """Prompt ids ``(1, T)``; a clear error if the tokenizer produces ids the model does not have."""
    ids = codec.encode(text, special=True)
    if not ids:
        raise ValueError("the prompt encodes to no tokens; give a non-empty --prompt")
    bad = max(ids)
    if bad >= vocab_size:
        raise IndexError(f"prompt token id {bad} out of range for the model's vocabulary of {vocab_size} "
                         "(does the tokenizer belong to this checkpoint?)")
    return torch.tensor([ids], dtype=torch.long)


def stream_text(codec: TextCodec, tokens: Iterable[int]) -> Iterator[str]:
    """Text pieces as tokens arrive; a piece is held back while it ends in an incomplete character."""
    stream = TextStream(codec)
    for tok in tokens:
        piece = stream.push(tok)
        if piece:
            yield piece
    piece = stream.finish()
    if piece:
        yield piece


class TextStream:
    """Incremental detokenization with stop strings: ``push`` a token, get the text that is safe to show.

    A piece is held back while it ends in an incomplete character or could be the start of a stop
    string; at the first stop string the text ends before it and ``stopped`` becomes true.
    """

    def __init__(self, codec: TextCodec, stops: Sequence[str] = ()):
        self.codec, self.stops = codec, [s for s in stops if s]
        self.ids: list[int] = []
        self.text = ""  # the text so far (cut before a stop string once one appears)
        self.shown = ""  # the part of it already handed out
        self.stopped = False

    def push(self, tok: int, *more: int) -> str:
        """Add one token (or several, decoded once); the new text that can be shown now (possibly empty)."""
        if self.stopped:
            return ""
        self.ids += [int(tok), *map(int, more)]
        self.text = self.codec.decode(self.ids)
        cut = min((i for i in (self.text.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.text, self.stopped = self.text[:cut], True
            return self._show(len(self.text))
        if self.text.endswith("\ufffd"):  # a multi-byte character split across tokens: wait for the rest
            return ""
        return self._show(len(self.text) - self._held(self.text))

    def finish(self) -> str:
        """The text still held back once no token will follow."""
        return self._show(len(self.text))

    def _held(self, text: str) -> int:
        """Length of the longest end of ``text`` that a stop string starts with."""
        return max((n for s in self.stops for n in range(min(len(s) - 1, len(text)), 0, -1)
                    if s.startswith(text[-n:])), default=0)

    def _show(self, end: int) -> str:
        if not self.text.startswith(self.shown) or end <= len(self.shown):
            return ""
        piece, self.shown = self.text[len(self.shown):end], self.text[:end]
        return piece
