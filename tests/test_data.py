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
