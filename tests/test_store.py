"""Tables on every tier behave exactly like tables in memory: logits, greedy tokens, saves, writes."""

import time

import pytest
import torch

from stemlm import StemLM, model_config
from stemlm.checkpoint.directory import save_model
from stemlm.store import open_model
from stemlm.inference.generate import generate_ids
from stemlm.checkpoint.safetensors_io import TableFileError
from stemlm.store import OffloadedTable, Placement, export_tables, offload_tables, open_model

CACHES = [0, 3, 10_000]  # none, tiny (constant evictions), everything fits


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    torch.manual_seed(0)
    cfg = model_config("debug", ffn="stem", stem_layers="1/2")  # tables on layers 1 and 3
    model = StemLM(cfg).eval()
    ckpt = tmp_path_factory.mktemp("store") / "ckpt"
    save_model(model, ckpt)
    batches = [torch.randint(0, 60, (2, 11)) for _ in range(3)]  # small id range: hits and evictions
    with torch.no_grad():
        ref = [model(b) for b in batches]
    greedy = generate_ids(model, batches[0][:1, :5], 6)
    return cfg, model, ckpt, batches, ref, greedy


def _check(model, store, batches, ref, greedy, prefetch):
    with torch.no_grad():
        for ids, want in zip(batches, ref):
            rows = store.prefetch(ids) if prefetch else None
            torch.testing.assert_close(model(ids, table_rows=rows), want, rtol=0, atol=1e-6)
    assert torch.equal(generate_ids(model, batches[0][:1, :5], 6), greedy)


@pytest.mark.parametrize("tier, cache_rows", [("device", 0)] + [(t, c) for t in ("host", "disk") for c in CACHES])
@pytest.mark.parametrize("prefetch", [True, False])
def test_checkpoint_on_every_tier_matches_memory(setup, tier, cache_rows, prefetch):
    cfg, _, ckpt, batches, ref, greedy = setup
    model = open_model(ckpt, Placement(tier, cache_rows=cache_rows, prefetch=prefetch))
    store = model.tables
    _check(model, store, batches, ref, greedy, prefetch)
    stats = store.stats()
    if tier != "device":
        n_layers = len(cfg.table_layers)
        assert stats["lookups"] > 0 and stats["bytes_moved"] == stats["rows_moved"] * cfg.d_ff * 4
        forwards = len(batches) + 6  # the batches, then prefill + 5 decode steps of generate_ids(..., 6)
        assert stats["prefetched"] == (forwards * n_layers if prefetch else 0)
        if cache_rows:
            assert stats["cache"]["hits"] + stats["cache"]["misses"] == stats["unique_rows"]
            assert stats["rows_moved"] == stats["cache"]["misses"]
        else:
            assert stats["rows_moved"] == stats["unique_rows"]
    store.close()


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_cache_window_matches_memory(setup, tier):
    cfg, _, ckpt, batches, ref, greedy = setup
    model = open_model(ckpt, Placement(tier, cache_rows=6, cache_window=0.5))
    store = model.tables
    _check(model, store, batches, ref, greedy, True)
    cache = store.stats()["cache"]
    assert cache["hits"] > 0 and cache["evictions"] > 0
    store.close()


@pytest.mark.parametrize("tier", ["host", "disk", "device"])
def test_offload_built_model_and_back(setup, tmp_path, tier):
    cfg, model, _, batches, ref, greedy = setup
    m = StemLM(cfg).eval()
    m.load_state_dict(model.state_dict())
    tables_file = tmp_path / "t.safetensors" if tier == "disk" else None
    store = offload_tables(m, Placement(tier, tables_file=tables_file, cache_rows=4)) if tier != "device" \
        else offload_tables(m, "device")
    _check(m, store, batches, ref, greedy, prefetch=True)
    store = offload_tables(m, Placement("host" if tier == "disk" else "disk", tables_file=tmp_path / "u.safetensors"))
    _check(m, store, batches, ref, greedy, prefetch=True)
    offload_tables(m, "device")
    assert all(type(t).__name__ == "StemTable" for t in m.tables.values())
    _check(m, store, batches, ref, greedy, prefetch=False)


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_save_from_offloaded_tier_roundtrips(setup, tmp_path, tier):
    cfg, model, ckpt, batches, ref, _ = setup
    m = open_model(ckpt, Placement(tier, cache_rows=5))
    store = m.tables
    save_model(m, tmp_path / "again")
    with torch.no_grad():
        torch.testing.assert_close(open_model(tmp_path / "again")(batches[1]), ref[1], rtol=0, atol=0)


def test_writes_are_coherent_with_cache_and_prefetch(setup, tmp_path):
    cfg, model, ckpt, batches, _, _ = setup
    tables_file = export_tables(ckpt, tmp_path / "tables.safetensors")
    ref_model = StemLM(cfg).eval()
    ref_model.load_state_dict(model.state_dict())
    m = open_model(ckpt, Placement("disk", tables_file=tables_file, writable=True, cache_rows=8))
    store = m.tables
    ids = batches[0]
    with torch.no_grad():
        m(ids)  # fill the caches
        rows = store.prefetch(ids)  # rows gathered now become stale with the write below
        target = ids.flatten()[:3].unique()
        for name, table in m.tables.items():
            new = torch.randn(len(target), cfg.d_ff)
            table.write_rows(target, new)
            ref_model.tables[name].write_rows(target, new)
            torch.testing.assert_close(table.read_rows(target), new)
        torch.testing.assert_close(m(ids, table_rows=rows), ref_model(ids), rtol=0, atol=1e-6)
    store.flush()
    reopened = open_model(ckpt, Placement("disk", tables_file=tables_file))  # the write reached the file
    with torch.no_grad():
        torch.testing.assert_close(reopened(ids), ref_model(ids), rtol=0, atol=1e-6)


def test_copy_on_write_leaves_checkpoint_untouched_and_readonly_refuses(setup):
    cfg, _, ckpt, _, _, _ = setup
    before = (ckpt / "model.safetensors").read_bytes()
    m = open_model(ckpt, Placement("disk", writable=True))
    table = m.tables[str(cfg.table_layers[0])]
    table.write_rows(torch.tensor([1, 2]), torch.ones(2, cfg.d_ff))
    assert torch.equal(table.read_rows(torch.tensor([2])), torch.ones(1, cfg.d_ff))
    assert (ckpt / "model.safetensors").read_bytes() == before
    ro = open_model(ckpt, "disk")
    with pytest.raises(PermissionError, match="read-only"):
        ro.tables[str(cfg.table_layers[0])].write_rows(torch.tensor([1]), torch.ones(1, cfg.d_ff))


def test_prefetched_rows_serve_only_the_forward_they_are_passed_to(setup):
    cfg, _, ckpt, batches, ref, _ = setup
    m = open_model(ckpt, "host")
    store = m.tables
    with torch.no_grad():
        store.prefetch(batches[0])  # a ticket not handed to the forward: it gathers synchronously
        torch.testing.assert_close(m(batches[1]), ref[1], rtol=0, atol=1e-6)
        assert store.stats()["prefetched"] == 0
        m(batches[1], table_rows=store.prefetch(batches[1]))
    s = store.stats()
    assert s["prefetched"] == len(cfg.table_layers) and 0 <= s["stalls"] <= s["prefetched"]


def test_slow_prefetch_stalls_but_gives_the_same_rows(setup, monkeypatch):
    cfg, _, ckpt, batches, ref, _ = setup
    m = open_model(ckpt, Placement("disk", cache_rows=3))
    store = m.tables
    for table in m.tables.values():  # lookups now overtake the worker: they must wait, not hang
        gather = table.backend.gather
        monkeypatch.setattr(table.backend, "gather", lambda ids, g=gather: (time.sleep(0.2), g(ids))[1])
    with torch.no_grad():
        for ids, want in zip(batches, ref):
            torch.testing.assert_close(m(ids, table_rows=store.prefetch(ids)), want, rtol=0, atol=1e-6)
    s = store.stats()
    assert s["prefetched"] == len(batches) * len(cfg.table_layers) and s["stalls"] >= 1


def test_out_of_range_ids_are_clear(setup):
    cfg, _, ckpt, _, _, _ = setup
    m = open_model(ckpt, Placement("disk", cache_rows=4))
    store = m.tables
    bad = torch.tensor([[1, cfg.vocab_size]])
    with pytest.raises(IndexError, match="out of range"):
        store.prefetch(bad)
    with pytest.raises(IndexError, match="out of range"):
        m.tables[str(cfg.table_layers[0])].lookup(bad)


def _corrupt(path, how):
    data = bytearray(path.read_bytes())
    if how == "truncated":
        path.write_bytes(bytes(data[:-100]))
    elif how == "header":
        path.write_bytes(bytes(data[:8]) + b"{not json" + bytes(data[17:]))
    elif how == "short":
        path.write_bytes(b"\x01\x02")


@pytest.mark.parametrize("how, match", [("truncated", "truncated"), ("header", "not valid JSON"), ("short", "too short")])
def test_corrupt_tables_file_errors(setup, tmp_path, how, match):
    _, _, ckpt, _, _, _ = setup
    f = export_tables(ckpt, tmp_path / "t.safetensors")
    _corrupt(f, how)
    with pytest.raises(TableFileError, match=match):
        open_model(ckpt, Placement("disk", tables_file=f))


def test_missing_or_mismatched_tables_file_errors(setup, tmp_path):
    cfg, _, ckpt, _, _, _ = setup
    with pytest.raises(FileNotFoundError, match="does not exist"):
        open_model(ckpt, Placement("disk", tables_file=tmp_path / "nope.safetensors"))
    other = StemLM(cfg.replace(d_ff=96))
    save_model(other, tmp_path / "other")
    with pytest.raises(TableFileError, match="shape"):
        open_model(ckpt, Placement("host", tables_file=tmp_path / "other" / "model.safetensors"))
    plain = StemLM(model_config("debug", ffn="stem", stem_layers="2"))
    save_model(plain, tmp_path / "plain")
    with pytest.raises(TableFileError, match="no tensor"):
        open_model(ckpt, Placement("disk", tables_file=tmp_path / "plain" / "model.safetensors"))


def test_disk_tier_reads_only_touched_rows(setup, tmp_path):
    cfg, model, ckpt, _, _, _ = setup
    m = open_model(ckpt, Placement("disk", prefetch=False))
    store = m.tables
    table = m.tables[str(cfg.table_layers[0])]
    assert isinstance(table, OffloadedTable) and table.backend.weight.data_ptr() != 0
    with torch.no_grad():
        m(torch.tensor([[3, 3, 7]]))
    s = store.stats()
    assert s["rows_moved"] == 2 * len(cfg.table_layers) and s["unique_rows"] == s["rows_moved"]


def test_bad_tier_and_options_are_clear(setup):
    cfg, model, _, _, _, _ = setup
    with pytest.raises(ValueError, match="unknown table tier"):
        offload_tables(StemLM(cfg), "gpu")
    with pytest.raises(ValueError, match="needs a tables file"):
        offload_tables(StemLM(cfg), "disk")
    with pytest.raises(ValueError, match="host and disk"):
        offload_tables(StemLM(cfg), Placement("device", cache_rows=4))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_disk_rows_pread_matches_the_mapping(tmp_path, dtype):
    from stemlm.store.backends import DiskRows
    from stemlm.checkpoint.safetensors_io import write_safetensors

    weight = torch.randn(50, 12).to(dtype)
    path = write_safetensors(tmp_path / "t.safetensors", [("w", dtype, (50, 12), lambda a, b: weight[a:b])])
    rows = DiskRows(path, "w", (50, 12))  # mode "r": pread
    assert rows._file is not None
    ids = torch.tensor([0, 1, 2, 7, 9, 10, 49])  # runs of consecutive ids and singles, both ends
    assert torch.equal(rows.gather(ids), weight[ids]) and rows.gather(ids).dtype == dtype
    assert rows.gather(torch.tensor([], dtype=torch.long)).shape == (0, 12)
    with open(path, "r+b") as f:  # truncated under the reader
        f.truncate(path.stat().st_size - 10)
    with pytest.raises(TableFileError, match="shorter than its header"):
        rows.gather(torch.tensor([49]))
    rows.close()


@pytest.mark.parametrize("mode", ["r", "c", "r+"])
def test_a_file_truncated_after_its_header_is_refused_before_mapping(tmp_path, mode):
    """A mapped page past the end of the file would be a SIGBUS on first touch; the size is checked first."""
    from stemlm.checkpoint.safetensors_io import map_tensor, tensor_info, write_safetensors

    weight = torch.randn(50, 12)
    path = write_safetensors(tmp_path / "t.safetensors", [("w", torch.float32, (50, 12), lambda a, b: weight[a:b])])
    info = tensor_info(path, "w", (50, 12))
    before = path.read_bytes()
    tensor, mm = map_tensor(path, info, mode)
    assert torch.equal(tensor, weight)
    del tensor, mm
    assert path.read_bytes() == before  # mapping (even writable) writes nothing by itself
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 100)
    with pytest.raises(TableFileError, match="truncated"):
        map_tensor(path, info, mode)


def test_disk_read_ahead_hints_each_run_of_rows_once(setup, tmp_path, monkeypatch):
    import os

    from stemlm.store.backends import DiskRows, HostRows
    from stemlm.checkpoint.safetensors_io import write_safetensors

    weight = torch.randn(50, 12)
    path = write_safetensors(tmp_path / "t.safetensors", [("w", torch.float32, (50, 12), lambda a, b: weight[a:b])])
    rows = DiskRows(path, "w", (50, 12))
    hints = []
    real = os.posix_fadvise
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, off, n, advice: (
        hints.append((off, n)) if advice == os.POSIX_FADV_WILLNEED else None, real(fd, off, n, advice))[1])
    rows.advise(torch.tensor([0, 1, 2, 7, 9, 10, 49]))
    rb, at = 12 * 4, rows._offset
    assert hints == [(at, 3 * rb), (at + 7 * rb, rb), (at + 9 * rb, 2 * rb), (at + 49 * rb, rb)]
    assert torch.equal(rows.gather(torch.tensor([7, 9, 10])), weight[[7, 9, 10]])
    assert rows.reads_ahead and not HostRows(weight).reads_ahead
    rows.close()

    # a table hints only the rows its hot-row cache does not hold; only disk tiers get the thread
    cfg, _, ckpt, batches, ref, _ = setup
    m = open_model(ckpt, Placement("disk", cache_rows=10_000, prefetch=False))
    store = m.tables
    uniq = batches[0].unique()
    hints.clear()
    for table in m.tables.values():
        table.advise(uniq)
    assert sum(n for _, n in hints) == len(uniq) * len(cfg.table_layers) * cfg.d_ff * 4
    with torch.no_grad():
        torch.testing.assert_close(m(batches[0]), ref[0], rtol=0, atol=1e-6)  # fills the caches
    hints.clear()
    for table in m.tables.values():
        table.advise(uniq)
    assert hints == []
    for hinted in (True, False):  # the prefetch worker hints every disk layer's rows (unless told not to)
        m = open_model(ckpt, "disk")
        store = m.tables
        store.prefetcher.read_ahead = hinted
        hints.clear()
        with torch.no_grad():
            torch.testing.assert_close(m(batches[1], table_rows=store.prefetch(batches[1])), ref[1], rtol=0, atol=1e-6)
        assert sum(n for _, n in hints) == (len(batches[1].unique()) * len(cfg.table_layers) * cfg.d_ff * 4) * hinted
        store.close()


def _open_fds() -> int:
    import os

    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not __import__("os").path.isdir("/proc/self/fd"), reason="needs /proc to count descriptors")
def test_disk_tier_descriptors_are_closed(setup, tmp_path):
    import gc

    from stemlm.store.backends import DiskRows

    cfg, _, ckpt, batches, ref, greedy = setup
    gc.collect()
    base = _open_fds()
    model = open_model(ckpt, "host")
    store = model.tables  # read from the file, then served from RAM
    assert _open_fds() == base
    model = open_model(ckpt, "disk")
    store = model.tables
    with store:
        _check(model, store, batches, ref, greedy, True)
        assert _open_fds() > base
    gc.collect()
    assert _open_fds() == base  # closed by the store's context manager, the model still alive
    model = open_model(ckpt, "disk")
    store = model.tables
    _check(model, store, batches, ref, greedy, True)
    assert _open_fds() > base
    del model, store  # released without close(): the descriptors go with the model
    gc.collect()
    assert _open_fds() == base
    with DiskRows(ckpt / "model.safetensors", "model.tables.1.weight") as rows:
        assert _open_fds() > base and rows.gather(torch.tensor([3])).shape == (1, cfg.d_ff)
    rows.close()  # idempotent
    gc.collect()
    assert _open_fds() == base


@pytest.mark.parametrize("tier, prefetch", [("device", False), ("host", False), ("host", True), ("disk", False),
                                            ("disk", True)])
def test_one_forward_makes_the_ids_unique_once_for_every_layer(tmp_path, monkeypatch, tier, prefetch):
    cfg = model_config("debug", ffn="stem", stem_layers="full")
    assert len(cfg.table_layers) > 1
    torch.manual_seed(0)
    model = StemLM(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (2, 9))
    with torch.no_grad():
        want = model(ids)
    tables_file = tmp_path / "t.safetensors" if tier == "disk" else None
    store = offload_tables(model, Placement(tier, tables_file=tables_file, prefetch=prefetch))
    assert model.tables is store
    calls = []
    real = torch.unique
    monkeypatch.setattr(torch, "unique", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    with torch.no_grad():
        got = model(ids, table_rows=store.prefetch(ids))
    assert len(calls) == 1  # one torch.unique for all table layers (in the prefetch, or else in the forward)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    if tier != "device":
        s = store.stats()
        assert s["lookups"] == len(cfg.table_layers) and s["prefetched"] == (len(cfg.table_layers) if prefetch else 0)
    store.close()


def test_table_rows_passed_explicitly_replace_the_lookup(setup):
    cfg, model, _, batches, ref, _ = setup
    ids = batches[0]
    rows = {k: t.weight.detach()[ids] for k, t in model.tables.items()}  # (B, T, d_ff) per layer
    with torch.no_grad():
        torch.testing.assert_close(model(ids, table_rows=rows), ref[0], rtol=0, atol=1e-6)
        zero = {k: torch.zeros_like(r) for k, r in rows.items()}
        assert not torch.allclose(model(ids, table_rows=zero), ref[0])
        with pytest.raises(ValueError, match=f"no rows for table layer.* {cfg.table_layers[-1]}"):
            model(ids, table_rows={str(cfg.table_layers[0]): rows[str(cfg.table_layers[0])]})


def test_the_prefetch_worker_runs_torch_alone_and_others_keep_their_threads():
    """On a CPU compute device the prefetcher's worker runs torch's operators single-threaded (no OpenMP team
    of its own, ``stemlm.runtime.threads``); the creating thread and threads started later keep the count."""
    import threading

    from stemlm.store.prefetch import Prefetcher

    before = torch.get_num_threads()
    pre = Prefetcher({}, device="cpu")
    try:
        assert pre._pool.submit(torch.get_num_threads).result() == 1
        assert torch.get_num_threads() == before
        seen = []
        t = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
        t.start()
        t.join()
        assert seen == [before]
    finally:
        pre.close()
