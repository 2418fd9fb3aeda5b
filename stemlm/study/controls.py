"""The corpora of the probes' positive controls, in the tokenizer of the study's own corpus.

A probe that reports nothing proves nothing unless it is first shown to succeed where the effect
is there by construction:

* ``facts``: the country facts alone (``prepare_default_corpus(prose=False)``) tokenized with the
  study corpus's tokenizer: a model trained on it has stored the seen countries' facts, so the
  knowledge probe's seen − unseen contrast must come out clearly positive;
* ``passkey``: documents that hide a pass key and a decoy of the same shape in Wikipedia prose and
  end with the question and the key (``probes.passkey_documents``; keys of the needle probe's kind,
  ``data["key"]``): a model trained on them retrieves the key, so the needle probe must find it
  greedily in at least half of its trials (``evidence.RETRIEVAL_GOAL``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from ..runtime.files import atomic_write_text

PASSKEY_DOCS = 12000


def study_corpus(data_dir: str | None) -> Path:
    """The study's corpus: a data dir, or a named offline corpus (``default`` when the spec names none, or
    ``wide``), built on first use."""
    from ..data import prepare_default_corpus

    if data_dir == "wide":
        from ..data.wide import prepare_wide_corpus
        return prepare_wide_corpus(progress=False)
    return Path(data_dir) if data_dir and data_dir != "default" else prepare_default_corpus(progress=False)


def control_corpus(data: dict, data_dir: str | None, root: Path, log: Callable[[str], None] = print) -> Path:
    """The prepared data dir of a control run (``data["control"]``: ``facts`` or ``passkey``)."""
    from ..data import prepare_corpus, prepare_default_corpus

    tokenizer = study_corpus(data_dir) / "tokenizer.json"
    kind = data["control"]
    if kind == "facts":
        return prepare_default_corpus(Path(root) / "facts", tokenizer=tokenizer, prose=False, progress=False)
    if kind == "passkey":
        from .probes import needle_values, passkey_documents

        length, key = int(data.get("seq_len", 512)), data.get("key", "number")
        name = f"passkey-{length}" if key == "number" else f"passkey-{key}-{length}"
        src = Path(root) / f"{name}.jsonl"
        if not src.exists():
            log(f"writing {PASSKEY_DOCS} pass-key documents ({key} keys) -> {src}")
            src.parent.mkdir(parents=True, exist_ok=True)
            # ~4 characters per token: haystacks of up to ~40 % of the window, several documents per window
            docs = passkey_documents(PASSKEY_DOCS, int(1.6 * length), values=needle_values(key, tokenizer))
            atomic_write_text(src, "".join(json.dumps({"text": d}) + "\n" for d in docs))
        return prepare_corpus([src], Path(root) / name, tokenizer=tokenizer, progress=False)
    raise ValueError(f"unknown control corpus {kind!r}; choose facts or passkey")
