"""The one tokenizer adapter: ``TextCodec`` over stemlm's ``tokenizers.Tokenizer`` or a transformers tokenizer,
and ``load_codec``, the one way to find a checkpoint's tokenizer.

Generation, serving, evaluation and editing all hold a ``TextCodec``. What differs between the two
kinds of tokenizer is decided here, once:

* stemlm tokenizers (``tokenizer.json`` of ``stemlm data``): every document starts with
  ``<|endoftext|>``, so a prompt starts with it too (``prefix_ids``), and it ends generation;
* Hugging Face tokenizers (a converted checkpoint, a Llama directory, a GGUF file): the
  tokenizer's own leading special tokens, as lm-evaluation-harness's ``hf`` backend uses them; an
  empty context becomes the BOS token (EOS if there is none), and EOS ends generation.

``canonical_ids`` maps every token to its canonical form (lower case, no leading space), the token
map of n-gram keys with ``ngram_normalize`` (``stemlm.ffn.ngram``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from functools import cached_property
from pathlib import Path

import torch
from tokenizers import Tokenizer

from .tokenizer import SPECIAL_TOKENS, eos_id_of, find_tokenizer, run_places

UNK_TOKENS = ("<unk>", "[UNK]", "<|unk|>")


class TextCodec:
    """``encode(text) -> ids`` / ``decode(ids) -> text`` and the special ids of one tokenizer.

    ``tokenizer``: a ``tokenizers.Tokenizer`` (stemlm's) or a transformers tokenizer (``hf``,
    detected when not given). ``files`` are the files it was read from (part of a model's identity).
    """

    def __init__(self, tokenizer, hf: bool | None = None, files: Sequence[Path] = ()):
        self.tokenizer = tokenizer
        self.hf = not isinstance(tokenizer, Tokenizer) if hf is None else hf
        self.files = tuple(files)
        if self.hf:
            self.eos_id = tokenizer.eos_token_id
            self.vocab_size = len(tokenizer)
        else:
            try:
                self.eos_id = eos_id_of(tokenizer)
            except ValueError:
                self.eos_id = None
            self.vocab_size = tokenizer.get_vocab_size()

    @classmethod
    def of(cls, tokenizer) -> "TextCodec":
        """``tokenizer`` itself if it is a ``TextCodec``, else one around it."""
        return tokenizer if isinstance(tokenizer, TextCodec) else cls(tokenizer)

    # -- text ---------------------------------------------------------------------------------
    def encode(self, text: str, special: bool = False) -> list[int]:
        """Ids of ``text``; ``special=True`` adds what starts a prompt: the HF tokenizer's own special
        tokens, or the document-start ``<|endoftext|>`` of a stemlm tokenizer."""
        if self.hf:
            return list(self.tokenizer.encode(text, add_special_tokens=special))
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        return ([self.eos_id] if special and self.eos_id is not None else []) + ids

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
        """Text of ``ids`` (special tokens dropped unless ``skip_special=False``)."""
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special)

    # -- special ids --------------------------------------------------------------------------
    @property
    def eot_id(self) -> int:
        """The token a context starts from when it is empty: stemlm's document start, a HF tokenizer's
        BOS (else EOS); a ``ValueError`` when the tokenizer has none."""
        tid = self.eos_id if not self.hf else (self.tokenizer.bos_token_id if self.tokenizer.bos_token_id is not None
                                              else self.eos_id)
        if tid is None:
            raise ValueError("the tokenizer has neither a BOS nor an EOS token" if self.hf else
                             "the tokenizer has no end-of-text token (looked for '<|endoftext|>', '</s>', '<eos>')")
        return tid

    @property
    def stop_id(self) -> int | None:
        """The token that ends generation: the end of text (of a document, for stemlm's tokenizers)."""
        return self.eos_id

    @cached_property
    def prefix_ids(self) -> list[int]:
        """The ids that lead every context (document start, or a HF tokenizer's leading special tokens)."""
        if not self.hf:
            return [self.eot_id]
        with_special = self.tokenizer.encode("a")
        plain = self.tokenizer.encode("a", add_special_tokens=False)
        n_lead = len(with_special) - len(plain) if with_special[-len(plain):] == plain else 0
        return list(with_special[:max(n_lead, 0)])

    @property
    def special_ids(self) -> set[int]:
        """Ids of the tokenizer's special tokens (stemlm's ``<|endoftext|>`` and ``<|pad|>``)."""
        if self.hf:
            return set(self.tokenizer.all_special_ids)
        return {t for t in map(self.tokenizer.token_to_id, SPECIAL_TOKENS) if t is not None}

    @property
    def unk_id(self) -> int | None:
        """The unknown token's id, if the tokenizer has one."""
        if self.hf:
            return self.tokenizer.unk_token_id
        return next((int(t) for t in map(self.tokenizer.token_to_id, UNK_TOKENS) if t is not None), None)

    def token_text(self, token_id: int) -> str:
        """Readable text of one token as the tokenizer's own ``decode`` gives it (byte-level markers decoded)."""
        return self.tokenizer.decode([int(token_id)])


def load_codec(ckpt: str | os.PathLike | None = None, tokenizer: str | os.PathLike | None = None,
               data_dir: str | os.PathLike | None = None, prefer: str = "stemlm", gguf_file: str | None = None,
               hint: str = "pass --tokenizer PATH (e.g. the data dir of `stemlm data prepare`)") -> TextCodec:
    """The tokenizer ``tokenizer`` (a file or directory) if given, else that of the checkpoint directory
    ``ckpt`` or of the training run around it (``run/checkpoints/step_X`` -> ``run``), else that of the
    prepared ``data_dir``. ``prefer`` and ``gguf_file`` are ``find_tokenizer``'s: ``"hf"`` tokenizes a
    converted checkpoint as lm-evaluation-harness does, ``"transformers"`` gives a tokenizer that
    ``save_pretrained`` can write. ``FileNotFoundError`` names the places tried, then ``hint``."""
    places = [tokenizer] if tokenizer is not None else [*(run_places(ckpt) if ckpt is not None else ()), data_dir]
    found = find_tokenizer(*places, prefer=prefer, gguf_file=gguf_file, hint=hint)
    return TextCodec(found.tokenizer, found.hf, found.files)


# -- canonical tokens (n-gram normalisation) ------------------------------------------------------
SPACE_MARKERS = ("\u0120", "\u2581")  # 'Ġ' (byte-level BPE) and '▁' (SentencePiece): a leading space


def _byte_alphabet() -> dict[int, str]:
    """Byte-level BPE's printable stand-in of every byte (GPT-2's ``bytes_to_unicode``, as the
    ``tokenizers`` ByteLevel pre-tokenizer uses it): byte ``b`` -> one character."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1), *range(ord("\u00ae"), ord("\u00ff") + 1)]
    out, extra = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in out:
            out[b] = chr(256 + extra)
            extra += 1
    return out


def _vocab_and_specials(tokenizer) -> tuple[dict[str, int], set[int]]:
    """``(token string -> id, special ids)`` of a ``TextCodec``, a ``tokenizers.Tokenizer`` or a transformers tokenizer."""
    tok = tokenizer.tokenizer if isinstance(tokenizer, TextCodec) else tokenizer
    if isinstance(tok, Tokenizer):
        specials = {i for i, t in tok.get_added_tokens_decoder().items() if t.special}
        return tok.get_vocab(with_added_tokens=True), specials
    return dict(tok.get_vocab()), set(getattr(tok, "all_special_ids", ()))


def canonical_ids(tokenizer, vocab_size: int | None = None) -> torch.Tensor:
    """``(V,)`` int64: every token id -> the id of its canonical form when that form is itself a token,
    else the id itself (``ngram_normalize``: the n-gram keys of ``stemlm.ffn.ngram`` hash canonical tokens).

    The canonical form of a token is its text with one leading space removed (a space, or the marker
    that stands for it in the vocabulary: ``Ġ`` of byte-level BPE, ``▁`` of SentencePiece), then lower-cased:
    ``"Spain"``, ``" Spain"`` (``"ĠSpain"``) and ``" spain"`` all map to the token ``"spain"`` if the
    vocabulary has it, and each stays itself otherwise. Byte-level tokens are read as their UTF-8 bytes
    (a token that is part of a character has no text and stays itself), so case folds correctly beyond
    ASCII; special tokens stay themselves. The map is idempotent: a canonical token maps to itself.

    ``tokenizer``: a ``TextCodec``, a ``tokenizers.Tokenizer`` or a transformers tokenizer. ``V`` is
    ``vocab_size`` when given (a model's vocabulary may be larger than its tokenizer's: the ids beyond map
    to themselves, and a canonical form at or beyond ``vocab_size`` is not used), else the tokenizer's.
    """
    vocab, specials = _vocab_and_specials(tokenizer)
    size = vocab_size if vocab_size is not None else max(vocab.values(), default=-1) + 1
    if size < 0:
        raise ValueError(f"vocab_size must be >= 0, got {vocab_size}")
    alphabet = _byte_alphabet()
    byte_of = {c: b for b, c in alphabet.items()}
    byte_level = all(c in vocab for c in alphabet.values())  # a byte-level BPE holds every byte's character

    def text_of(token: str) -> str | None:
        if byte_level and all(c in byte_of for c in token):
            try:
                return bytes(byte_of[c] for c in token).decode("utf-8")
            except UnicodeDecodeError:  # a piece of a multi-byte character
                return None
        return token.replace(SPACE_MARKERS[1], " ")

    def spellings(text: str) -> list[str]:  # how a text is written in the vocabulary, most likely first
        out = ["".join(alphabet[b] for b in text.encode("utf-8"))] if byte_level else [text.replace(" ", SPACE_MARKERS[1])]
        return out + [text]  # an added token holds its raw text

    out = torch.arange(size, dtype=torch.long)
    for token, tid in vocab.items():
        if tid >= size or tid in specials:
            continue
        text = text_of(token)
        if not text:
            continue
        canon = (text[1:] if text[0] == " " else text).lower()
        target = next((vocab[s] for s in spellings(canon) if s in vocab), None) if canon else None
        if target is not None and target < size and target not in specials:
            out[tid] = target
    return out
