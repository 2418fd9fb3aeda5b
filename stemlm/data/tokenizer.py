"""Byte-level BPE tokenizer: train on a corpus, load, encode fast, count single-token words.

Conventions: ``<|endoftext|>`` separates (and starts) documents, ``<|pad|>`` pads. The ByteLevel
pre-tokenizer uses ``add_prefix_space=False``, so " Spain" (with the space that precedes a name in
running text and in the fact prompts) is the unit that may become a single token, not "Spain".
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
SPECIAL_TOKENS = [EOS_TOKEN, PAD_TOKEN]


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
    """Convert a SentencePiece ``.model`` with transformers' converter (needs ``sentencepiece``)."""
    try:
        from transformers import LlamaTokenizer
        from transformers.convert_slow_tokenizer import convert_slow_tokenizer
        slow = LlamaTokenizer(vocab_file=str(path))
        return convert_slow_tokenizer(slow)
    except ImportError as e:
        raise ValueError(f"loading SentencePiece model {path} needs the `sentencepiece` package ({e})") from None


def special_id(tok: Tokenizer, token: str = EOS_TOKEN) -> int:
    """Id of a special token (clear error if the tokenizer lacks it)."""
    tid = tok.token_to_id(token)
    if tid is None:
        raise ValueError(f"tokenizer has no {token!r} token; add it or train a tokenizer with `stemlm data prepare`")
    return tid


def eos_id_of(tok: Tokenizer) -> int:
    """The document separator id: ``<|endoftext|>``, else a common EOS spelling (``</s>``, ``<eos>``)."""
    for t in (EOS_TOKEN, "</s>", "<eos>", "<|end_of_text|>", "<|im_end|>"):
        tid = tok.token_to_id(t)
        if tid is not None:
            return tid
    raise ValueError(f"tokenizer has no end-of-text token (looked for {EOS_TOKEN!r}, '</s>', '<eos>')")


def train_bpe(texts: Iterable[str], vocab_size: int = 4096, extra_tokens: Iterable[str] = (),
              min_frequency: int = 2, length: int | None = None) -> Tokenizer:
    """Train a byte-level BPE on ``texts``.

    ``extra_tokens`` (e.g. " Spain", " Madrid") are added as whole tokens on top of the trained
    merges, so they always encode to one id; they count toward ``vocab_size``.
    """
    extra = sorted(set(extra_tokens))
    n_base = vocab_size - len(extra)
    if n_base < 256 + len(SPECIAL_TOKENS) + 1:
        raise ValueError(f"vocab_size {vocab_size} is too small: the 256 bytes, {len(SPECIAL_TOKENS)} special tokens "
                         f"and {len(extra)} added words need more")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=n_base, min_frequency=min_frequency, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer, length=length)
    if extra:
        # normalized=False: the word is matched in the raw text, before byte-level mapping.
        tok.add_tokens([AddedToken(w, single_word=True, normalized=False) for w in extra if tok.token_to_id(w) is None])
    return tok


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
