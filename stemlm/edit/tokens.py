"""Entity strings -> token ids with the model's tokenizer.

Byte-level BPE gives different ids to ``"Spain"`` and ``" Spain"``; inside a sentence
("The capital of Spain is") the entity carries its leading space, so ``entity_ids`` prepends
one unless ``leading_space=False`` or the string already starts with whitespace.

Every function takes a ``stemlm.data.codec.TextCodec`` or a bare tokenizer (a ``tokenizers.Tokenizer``
or a ``transformers`` one), which it wraps in one.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..data.codec import TextCodec


def eos_id(tokenizer) -> int:
    """Id of the tokenizer's end-of-text token (the default filler)."""
    tid = TextCodec.of(tokenizer).eos_id
    if tid is None:
        raise ValueError("the tokenizer has no end-of-text token; pass an explicit filler token")
    return int(tid)


def entity_ids(tokenizer, entity: str | Sequence[int], vocab_size: int | None = None,
               leading_space: bool = True) -> list[int]:
    """Token ids of an entity string (with a leading space by default), or ids passed through.

    Raises a one-line ``ValueError`` if the string is empty, needs the unknown token, or encodes
    to ids the model's tables do not have.
    """
    if not isinstance(entity, str):
        return [int(i) for i in entity]
    if tokenizer is None:
        raise ValueError(f"entity {entity!r} is a string but no tokenizer was given (pass token ids or a tokenizer)")
    if not entity.strip():
        raise ValueError("entity string is empty")
    codec = TextCodec.of(tokenizer)
    text = " " + entity if leading_space and not entity[0].isspace() else entity
    ids = codec.encode(text)
    unk = codec.unk_id
    if not ids or (unk is not None and unk in ids):
        raise ValueError(f"entity {text!r} is not in the tokenizer's vocabulary")
    if vocab_size is not None and max(ids) >= vocab_size:
        raise ValueError(f"entity {text!r} encodes to id {max(ids)}, outside the model's vocabulary of {vocab_size}")
    return ids


def describe(tokenizer, ids: Sequence[int]) -> str:
    """``"' United' ' States'"`` for a list of ids (for reports and error messages)."""
    if tokenizer is None:
        return " ".join(str(i) for i in ids)
    codec = TextCodec.of(tokenizer)
    return " ".join(repr(codec.token_text(i)) for i in ids)


def encode_prompt(tokenizer, text: str, prepend_eos: bool = True) -> list[int]:
    """Prompt ids; by default led by the EOS token, as every training document is."""
    codec = TextCodec.of(tokenizer)
    ids = codec.encode(text)
    if prepend_eos and codec.eos_id is not None:
        ids = [codec.eos_id] + ids
    return ids


def contains(haystack: Sequence[int], needle: Sequence[int]) -> bool:
    """Whether ``needle`` occurs as a contiguous run in ``haystack``."""
    n = len(needle)
    return any(list(haystack[i:i + n]) == list(needle) for i in range(len(haystack) - n + 1))
