"""Entity strings -> token ids with the model's tokenizer.

Byte-level BPE gives different ids to ``"Spain"`` and ``" Spain"``; inside a sentence
("The capital of Spain is") the entity carries its leading space, so ``entity_ids`` prepends
one unless ``leading_space=False`` or the string already starts with whitespace.

Tokenizers are duck-typed: a ``tokenizers.Tokenizer`` (``encode(text).ids``) or a
``transformers`` tokenizer (``encode(text, add_special_tokens=False)`` -> list).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path


def encode(tokenizer, text: str) -> list[int]:
    """Ids of ``text`` without special tokens."""
    try:
        out = tokenizer.encode(text, add_special_tokens=False)
    except TypeError:
        out = tokenizer.encode(text)
    return list(out.ids if hasattr(out, "ids") else out)


def decode_token(tokenizer, token_id: int) -> str:
    """Readable text of one token (byte-level markers decoded)."""
    return tokenizer.decode([int(token_id)])


def load_tokenizer(ckpt: str | Path, data_dir: str | Path | None = None):
    """The tokenizer of a checkpoint or run (in the checkpoint, else in the run around it), else of
    the prepared ``data_dir``; see ``data.tokenizer.find_tokenizer``."""
    from ..interop.checkpoint import resolve_checkpoint
    from ..data.tokenizer import find_tokenizer, run_places

    found = find_tokenizer(*run_places(resolve_checkpoint(ckpt)), data_dir,
                           hint="pass --data DIR with a prepared corpus")
    return found.tokenizer


def eos_id(tokenizer) -> int:
    """Id of the tokenizer's end-of-text token (the default filler)."""
    if hasattr(tokenizer, "token_to_id"):
        from ..data.tokenizer import eos_id_of

        return int(eos_id_of(tokenizer))
    tid = getattr(tokenizer, "eos_token_id", None)
    if tid is None:
        raise ValueError("the tokenizer has no end-of-text token; pass an explicit filler token")
    return int(tid)


def _unk_id(tokenizer) -> int | None:
    for name in ("<unk>", "[UNK]", "<|unk|>"):
        tid = tokenizer.token_to_id(name) if hasattr(tokenizer, "token_to_id") else None
        if tid is not None:
            return int(tid)
    return getattr(tokenizer, "unk_token_id", None)


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
    text = " " + entity if leading_space and not entity[0].isspace() else entity
    ids = encode(tokenizer, text)
    unk = _unk_id(tokenizer)
    if not ids or (unk is not None and unk in ids):
        raise ValueError(f"entity {text!r} is not in the tokenizer's vocabulary")
    if vocab_size is not None and max(ids) >= vocab_size:
        raise ValueError(f"entity {text!r} encodes to id {max(ids)}, outside the model's vocabulary of {vocab_size}")
    return ids


def describe(tokenizer, ids: Sequence[int]) -> str:
    """``"' United' ' States'"`` for a list of ids (for reports and error messages)."""
    if tokenizer is None:
        return " ".join(str(i) for i in ids)
    return " ".join(repr(decode_token(tokenizer, i)) for i in ids)


def encode_prompt(tokenizer, text: str, prepend_eos: bool = True) -> list[int]:
    """Prompt ids; by default led by the EOS token, as every training document is."""
    ids = encode(tokenizer, text)
    if prepend_eos:
        try:
            ids = [eos_id(tokenizer)] + ids
        except ValueError:
            pass
    return ids


def contains(haystack: Sequence[int], needle: Sequence[int]) -> bool:
    """Whether ``needle`` occurs as a contiguous run in ``haystack``."""
    n = len(needle)
    return any(list(haystack[i:i + n]) == list(needle) for i in range(len(haystack) - n + 1))
