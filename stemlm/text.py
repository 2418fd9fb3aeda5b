"""Text in, text out around ``generate``: the checkpoint's tokenizer and streamed detokenization.

A checkpoint directory carries its tokenizer (``tokenizer.json`` from ``stemlm data``, a
SentencePiece ``tokenizer.model``, or Hugging Face tokenizer files). stemlm's own corpus starts
every document with ``<|endoftext|>``, so prompts get that token in front, as in training.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator

import torch

from .data.tokenizer import eos_id_of, find_tokenizer, run_places


class TextCodec:
    """``encode(text) -> ids`` / ``decode(ids) -> text`` over a ``tokenizers`` or HF tokenizer."""

    def __init__(self, tokenizer, hf: bool = False):
        self.tokenizer, self.hf = tokenizer, hf
        if hf:
            self.eos_id = tokenizer.eos_token_id
        else:
            try:
                self.eos_id = eos_id_of(tokenizer)
            except ValueError:
                self.eos_id = None

    def encode(self, text: str) -> list[int]:
        """Prompt ids: the HF tokenizer's own special tokens, or ``[eos] + ids`` (document start)."""
        if self.hf:
            return list(self.tokenizer(text)["input_ids"])
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        return ([self.eos_id] if self.eos_id is not None else []) + ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def load_text_codec(ckpt_dir: str | os.PathLike, tokenizer: str | os.PathLike | None = None) -> TextCodec:
    """The tokenizer of ``tokenizer`` (a file or directory) if given, else of the checkpoint dir or
    the training run around it (``run/checkpoints/step_X`` -> ``run``); see ``find_tokenizer``."""
    if tokenizer is not None:
        found = find_tokenizer(tokenizer)
    else:
        found = find_tokenizer(*run_places(ckpt_dir), hint="pass --tokenizer PATH (e.g. the data dir of "
                               "`stemlm data prepare`)")
    return TextCodec(found.tokenizer, hf=found.hf)


def encode_prompt(codec: TextCodec, text: str, vocab_size: int) -> torch.Tensor:
    """Prompt ids ``(1, T)``; a clear error if the tokenizer produces ids the model does not have."""
    ids = codec.encode(text)
    if not ids:
        raise ValueError("the prompt encodes to no tokens; give a non-empty --prompt")
    bad = max(ids)
    if bad >= vocab_size:
        raise IndexError(f"prompt token id {bad} out of range for the model's vocabulary of {vocab_size} "
                         "(does the tokenizer belong to this checkpoint?)")
    return torch.tensor([ids], dtype=torch.long)


def stream_text(codec: TextCodec, tokens: Iterable[int]) -> Iterator[str]:
    """Text pieces as tokens arrive; a piece is held back while it ends in an incomplete character."""
    ids: list[int] = []
    shown = ""
    for tok in tokens:
        ids.append(int(tok))
        text = codec.decode(ids)
        if text.endswith("\ufffd"):  # a multi-byte character split across tokens: wait for the rest
            continue
        if text.startswith(shown):
            piece, shown = text[len(shown):], text
            if piece:
                yield piece
    text = codec.decode(ids)
    if text.startswith(shown) and text[len(shown):]:
        yield text[len(shown):]
