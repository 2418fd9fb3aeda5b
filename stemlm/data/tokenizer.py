"""Tokenizers: train a byte-level BPE on a corpus, load one, find a checkpoint's (``find_tokenizer``), encode fast.

Conventions: ``<|endoftext|>`` separates (and starts) documents, ``<|pad|>`` pads. The ByteLevel
pre-tokenizer uses ``add_prefix_space=False``, so " Spain" (with the space that precedes a name in
running text and in the fact prompts) is the unit that may become a single token, not "Spain".
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
SPECIAL_TOKENS = [EOS_TOKEN, PAD_TOKEN]
STEMLM_FILES = ("tokenizer.json", "tokenizer.model")  # read by ``load_tokenizer``
HF_CONFIG_FILE = "tokenizer_config.json"  # marks a Hugging Face tokenizer directory
# Any of these lets transformers' AutoTokenizer build a tokenizer from a directory.
TRANSFORMERS_FILES = ("tokenizer.json", HF_CONFIG_FILE, "tokenizer.model", "vocab.json")
PREFERENCES = ("stemlm", "hf", "transformers")


@dataclass(frozen=True)
class FoundTokenizer:
    """A tokenizer and the files it was read from.

    ``tokenizer`` is a ``tokenizers.Tokenizer`` when ``hf`` is False, else a transformers
    tokenizer (``AutoTokenizer``).
    """

    tokenizer: object
    hf: bool
    files: tuple[Path, ...]


def run_places(ckpt: str | os.PathLike) -> tuple[Path, Path]:
    """Where a checkpoint's tokenizer may be: the checkpoint, then the training run around it
    (``run/checkpoints/step_X`` -> ``run``)."""
    ckpt = Path(ckpt)
    return ckpt, ckpt.parent.parent


def find_tokenizer(*places: str | os.PathLike | None, prefer: str = "stemlm", gguf_file: str | None = None,
                   hint: str = "") -> FoundTokenizer:
    """The tokenizer of the first of ``places`` (files or directories; None is skipped) that has one.

    A file is read by ``load_tokenizer`` (``tokenizer.json`` or a SentencePiece ``.model``). In a
    directory, ``prefer`` picks the order:

    * ``"stemlm"``: ``tokenizer.json``, then ``tokenizer.model``, then Hugging Face tokenizer
      files (``tokenizer_config.json``) through transformers' ``AutoTokenizer``;
    * ``"hf"``: the Hugging Face files first, so a converted checkpoint tokenizes exactly as
      lm-evaluation-harness's ``hf`` backend does; stemlm's files otherwise;
    * ``"transformers"``: any tokenizer file (or ``gguf_file`` inside the directory) through
      ``AutoTokenizer``, giving a tokenizer that ``save_pretrained`` can write.

    Nothing is downloaded. ``FileNotFoundError`` names the places tried, followed by ``hint``.
    """
    if prefer not in PREFERENCES:
        raise ValueError(f"unknown tokenizer preference {prefer!r}; choose one of {', '.join(PREFERENCES)}")
    tried = []
    for place in places:
        if place is None:
            continue
        place = Path(place)
        tried.append(str(place))
        found = _read_file(place) if place.is_file() else _read_dir(place, prefer, gguf_file)
        if found is not None:
            return found
    where = ", ".join(tried) or "nowhere (no path given)"
    raise FileNotFoundError(f"no tokenizer in {where} (expected tokenizer.json, tokenizer.model or Hugging Face "
                            f"tokenizer files){'; ' + hint if hint else ''}")


def _read_file(path: Path) -> FoundTokenizer:
    return FoundTokenizer(load_tokenizer(path), False, (path,))


def _read_dir(where: Path, prefer: str, gguf_file: str | None) -> FoundTokenizer | None:
    if prefer == "transformers":
        if gguf_file is None and not any((where / name).exists() for name in TRANSFORMERS_FILES):
            return None
        return _read_hf(where, gguf_file)
    stemlm = next((where / name for name in STEMLM_FILES if (where / name).exists()), None)
    hf = (where / HF_CONFIG_FILE).exists()
    if hf and (prefer == "hf" or stemlm is None):
        return _read_hf(where, None)
    return _read_file(stemlm) if stemlm is not None else None


def _read_hf(where: Path, gguf_file: str | None) -> FoundTokenizer:
    from transformers import AutoTokenizer

    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    tokenizer = AutoTokenizer.from_pretrained(str(where), local_files_only=True, **kwargs)
    files = (where / gguf_file,) if gguf_file else tuple(p for p in sorted(where.glob("tokenizer*")) if p.is_file())
    return FoundTokenizer(tokenizer, True, files)


def load_tokenizer(path: Path) -> Tokenizer:
    """A ``tokenizers.Tokenizer`` from ``tokenizer.json`` (or a directory that contains it)."""
    path = Path(path)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.exists():
        raise FileNotFoundError(f"tokenizer file {path} does not exist")
    if path.suffix == ".model":
        return _from_sentencepiece(path)
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception on malformed JSON
        raise ValueError(f"{path} is not a valid tokenizer.json ({e})") from None


def _from_sentencepiece(path: Path) -> Tokenizer:
    """Convert a SentencePiece ``.model`` through transformers (needs the ``sentencepiece`` package)."""
    import importlib.util

    if importlib.util.find_spec("sentencepiece") is None:
        raise ValueError(f"loading SentencePiece model {path} needs the `sentencepiece` package (pip install sentencepiece)")
    try:
        from transformers import LlamaTokenizer

        tok = LlamaTokenizer(vocab_file=str(path)).backend_tokenizer
    except Exception as e:  # missing sentencepiece/protobuf or a malformed model file
        raise ValueError(f"could not load SentencePiece model {path} (needs the `sentencepiece` package): "
                         f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    if tok.get_vocab_size() <= 3:  # transformers falls back to an empty Llama vocab when it cannot read the file
        raise ValueError(f"could not read SentencePiece model {path}")
    return tok


def eos_id_of(tok: Tokenizer) -> int:
    """The document separator id: ``<|endoftext|>``, else a common EOS spelling (``</s>``, ``<eos>``)."""
    for t in (EOS_TOKEN, "</s>", "<eos>", "<|end_of_text|>", "<|im_end|>"):
        tid = tok.token_to_id(t)
        if tid is not None:
            return tid
    raise ValueError(f"tokenizer has no end-of-text token (looked for {EOS_TOKEN!r}, '</s>', '<eos>')")


def train_bpe(texts: Iterable[str], vocab_size: int = 4096, extra_tokens: Iterable[str] = (),
              min_frequency: int = 2, length: int | None = None) -> Tokenizer:
    """Train a byte-level BPE of at most ``vocab_size`` ids on ``texts``.

    ``extra_tokens`` (e.g. " Spain", " Buenos Aires") are made single tokens, see
    ``with_single_tokens``; they count toward ``vocab_size``.
    """
    if vocab_size < 256 + len(SPECIAL_TOKENS) + 1:
        raise ValueError(f"vocab_size {vocab_size} is too small: it must exceed the 256 bytes and "
                         f"{len(SPECIAL_TOKENS)} special tokens")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer, length=length)
    extra = sorted(set(extra_tokens))
    return with_single_tokens(tok, extra, vocab_size) if extra else tok


def with_single_tokens(tok: Tokenizer, words: list[str], vocab_size: int) -> Tokenizer:
    """A copy of BPE ``tok`` in which every word of ``words`` encodes to one token.

    A word that the pre-tokenizer keeps whole (" Madrid") gets extra merges appended at the lowest
    priority ("ĠMad" + "rid"), so it stays ordinary BPE: " Madridista" still shares the piece.
    A multi-word name (" Buenos Aires") cannot be one BPE piece and becomes an added token, matched
    in the raw text before pre-tokenization. To stay within ``vocab_size`` the least frequent
    trained merges (the last ones) are dropped first.
    """
    spec = json.loads(tok.to_str())
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in spec["model"]["merges"]]
    vocab = spec["model"]["vocab"]
    whole = [w for w in words if len(tok.pre_tokenizer.pre_tokenize_str(w)) == 1]
    multi = [w for w in words if w not in set(whole)]
    drop = 0
    while True:
        # Merge i creates the token with id len(vocab) - len(merges) + i, so dropping the last
        # merges drops the highest ids and keeps ids contiguous.
        keep = len(merges) - drop
        if keep < 0:
            raise ValueError(f"vocab_size {vocab_size} is too small for {len(words)} single-token words")
        limit = len(vocab) - drop
        cut = _bpe_tokenizer(spec, {t: i for t, i in vocab.items() if i < limit}, merges[:keep])
        out = _merge_words(cut, spec, whole)
        out.add_tokens([AddedToken(w, single_word=False, normalized=False) for w in multi])
        over = out.get_vocab_size() - vocab_size
        if over <= 0:
            return out
        drop += over


def _bpe_tokenizer(spec: dict, vocab: dict[str, int], merges: list[tuple[str, str]]) -> Tokenizer:
    spec = json.loads(json.dumps(spec))
    spec["model"]["vocab"], spec["model"]["merges"] = vocab, [list(m) for m in merges]
    return Tokenizer.from_str(json.dumps(spec))


def _merge_words(tok: Tokenizer, spec: dict, words: list[str], rounds: int = 8) -> Tokenizer:
    """Append merges until each of ``words`` (single pre-tokens) is one token."""
    for _ in range(rounds):
        split = [tok.encode(w, add_special_tokens=False).tokens for w in words]
        split = [pieces for pieces in split if len(pieces) > 1]
        if not split:
            return tok
        state = json.loads(tok.to_str())["model"]
        vocab, merges = state["vocab"], [tuple(m) for m in state["merges"]]
        known = set(merges)
        for pieces in split:  # join left to right: ((a b) c) d
            cur = pieces[0]
            for p in pieces[1:]:
                if (cur, p) not in known:
                    merges.append((cur, p))
                    known.add((cur, p))
                cur += p
                vocab.setdefault(cur, len(vocab))
        # A new merge may also fire inside another word; the next round fixes what is still split.
        tok = _bpe_tokenizer(spec, vocab, merges)
    still = [w for w in words if len(tok.encode(w, add_special_tokens=False).ids) > 1]
    raise ValueError(f"could not make {len(still)} words single tokens, e.g. {still[:3]}")


def encode_batch(tok: Tokenizer, texts: list[str], chunk: int = 2048, progress: bool = False,
                 desc: str = "tokenize") -> Iterator[np.ndarray]:
    """Ids of each text (no special tokens added), encoded in parallel chunks with ``encode_batch``."""
    from tqdm import tqdm

    bar = tqdm(total=len(texts), desc=desc, unit="doc", disable=not progress, leave=False)
    for i in range(0, len(texts), chunk):
        encs = tok.encode_batch(texts[i:i + chunk], add_special_tokens=False)
        for enc in encs:
            yield np.asarray(enc.ids, dtype=np.int64)
        bar.update(len(encs))
    bar.close()


def single_token_words(tok: Tokenizer, words: Iterable[str]) -> list[str]:
    """Those ``words`` (e.g. " Spain") that encode to exactly one token."""
    return [w for w in words if len(tok.encode(w, add_special_tokens=False).ids) == 1]
