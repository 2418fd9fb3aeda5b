"""The LFU hot-row cache: eviction order, statistics, warm start, aging, write-through."""

import numpy as np
import pytest
import torch

from stemlm import StemLM, model_config
from stemlm.store import HotRowCache, Placement, offload_tables

V, D = 40, 3
BACKING = torch.arange(V * D, dtype=torch.float32).view(V, D)


def load(ids):
    return BACKING[ids]


def fetch(cache, ids):
    ids = torch.tensor(sorted(set(ids)))
    rows = cache.fetch(ids, load)
    torch.testing.assert_close(rows, BACKING[ids], rtol=0, atol=0)  # hits and misses give the stored rows
    return rows


def resident(cache):
    return cache.resident_ids().tolist()


def test_lfu_eviction_order_and_stats():
    c = HotRowCache(V, D, capacity=2)
    fetch(c, [1])
    fetch(c, [2])
    assert resident(c) == [1, 2]
    fetch(c, [3])  # count 1 is not more than the residents' counts: turned away
    assert resident(c) == [1, 2] and c.evictions == 0
    fetch(c, [3])  # count 2 beats the coldest resident; 1 and 2 tie on count, 1 was used longer ago
    assert resident(c) == [2, 3] and c.evictions == 1
    fetch(c, [2, 2, 3])
    fetch(c, [1])
    fetch(c, [1])  # 1 reaches count 3 > 2's count 2, 3 has count 3: 2 goes
    assert resident(c) == [1, 3]
    s = c.stats()
    assert (s["hits"], s["misses"], s["evictions"]) == (2, 6, 2)
    assert s["hit_rate"] == pytest.approx(2 / 8) and s["resident_rows"] == 2


def test_rows_of_the_current_lookup_are_not_evicted_by_it():
    c = HotRowCache(V, D, capacity=2)
    for _ in range(3):
        fetch(c, [5, 6])
    for _ in range(5):
        fetch(c, [7])
    fetch(c, [5, 7])  # 7 (count 6) may evict 6 (count 3) but not 5, which this lookup uses
    assert resident(c) == [5, 7]


def _reference_lfu(stream, capacity):
    """The documented policy, written with plain Python sorts."""
    freq, last, res, clock, out = {}, {}, set(), 0, []
    for ids in stream:
        clock += 1
        for i in ids:
            freq[i] = freq.get(i, 0) + 1
            last[i] = clock
        missed = sorted((i for i in ids if i not in res), key=lambda i: (-freq[i], i))
        while missed and len(res) < capacity:
            res.add(missed.pop(0))
        victims = sorted((i for i in res if last[i] != clock), key=lambda i: (freq[i], last[i], i))
        for m, v in zip(missed, victims):
            if freq[m] <= freq[v]:
                break
            res.remove(v)
            res.add(m)
        out.append(sorted(res))
    return out


@pytest.mark.parametrize("capacity", [1, 4, 9])
def test_matches_reference_policy_on_a_zipf_stream(capacity):
    rng = np.random.default_rng(0)
    stream = [sorted(set((rng.zipf(1.3, size=rng.integers(1, 6)) - 1) % V)) for _ in range(300)]
    c = HotRowCache(V, D, capacity)
    want = _reference_lfu(stream, capacity)
    for ids, expected in zip(stream, want):
        fetch(c, ids)
        assert resident(c) == expected


def _reference_window(stream, capacity, window_rows):
    """W-TinyLFU as documented, one id per lookup: LRU window, LFU main, count-based admission."""
    freq, last, win, main, out = {}, {}, [], set(), []
    for clock, i in enumerate(stream, 1):
        freq[i] = freq.get(i, 0) + 1
        last[i] = clock
        if i in win:
            win.remove(i)
        if i not in main:
            win.append(i)  # most recent at the end
        if len(win) > window_rows:
            cand = win.pop(0)
            if len(main) < capacity - window_rows:
                main.add(cand)
            else:
                victim = min((m for m in main if last[m] != clock), key=lambda m: (freq[m], last[m], m), default=None)
                if victim is not None and freq[cand] > freq[victim]:
                    main.remove(victim)
                    main.add(cand)
        out.append(sorted(main | set(win)))
    return out


@pytest.mark.parametrize("capacity,window", [(5, 0.2), (10, 0.3), (3, 0.34)])
def test_window_matches_reference_policy(capacity, window):
    rng = np.random.default_rng(1)
    stream = [int(x) for x in (rng.zipf(1.2, size=400) - 1) % V]
    c = HotRowCache(V, D, capacity, window=window)
    want = _reference_window(stream, capacity, c.window_rows)
    for i, expected in zip(stream, want):
        fetch(c, [i])
        assert resident(c) == expected
    assert c.stats()["hits"] + c.stats()["misses"] == len(stream)


def test_window_with_batched_lookups_and_warm_start():
    rng = np.random.default_rng(2)
    c = HotRowCache(V, D, capacity=8, window=0.25)
    counts = np.bincount((rng.zipf(1.3, size=500) - 1) % V, minlength=V)
    c.warm(counts, load)
    assert len(resident(c)) == 8 and int(c.in_window.sum()) == 2
    for _ in range(200):  # values stay right and the segments within their sizes
        fetch(c, ((rng.zipf(1.3, size=rng.integers(1, 12)) - 1) % V).tolist())
        in_win = (c.id_of >= 0) & c.in_window
        assert int(in_win.sum()) <= c.window_rows and int(((c.id_of >= 0) & ~c.in_window).sum()) <= 6
    with pytest.raises(ValueError, match="window"):
        HotRowCache(V, D, capacity=4, window=1.0)


def test_warm_start_and_aging():
    counts = np.zeros(V, dtype=np.int64)
    counts[[4, 9, 13]] = [50, 30, 10]
    c = HotRowCache(V, D, capacity=2)
    c.warm(counts, load)
    assert resident(c) == [4, 9] and c.stats()["inserts"] == 0
    fetch(c, [4, 13])
    assert (c.hits, c.misses) == (1, 1)
    torch.testing.assert_close(c.slots[c.slot_of[torch.tensor([9])]], BACKING[[9]])
    aged = HotRowCache(V, D, capacity=1, decay_every=2)
    fetch(aged, [1])
    fetch(aged, [1])  # count 2 -> halved to 1 after the 2nd lookup
    assert int(aged.freq[1]) == 1
    with pytest.raises(ValueError, match="entries"):
        c.warm(np.ones(V + 1), load)


def test_write_through_updates_cached_copies():
    c = HotRowCache(V, D, capacity=3)
    fetch(c, [2, 8])
    new = torch.full((2, D), -1.0)
    c.update(torch.tensor([2, 30]), new)  # 2 is cached, 30 is not
    torch.testing.assert_close(c.fetch(torch.tensor([2]), load), new[:1])
    assert resident(c) == [2, 8]


def test_capacity_in_bytes_and_invalid_capacity():
    cfg = model_config("debug", ffn="stem", stem_layers="1/2")
    store = offload_tables(StemLM(cfg), Placement("host", cache_bytes=10 * cfg.d_ff * 4))
    assert store.stats()["cache"]["capacity_rows"] == 10 * len(cfg.table_layers)
    with pytest.raises(ValueError, match="at least one row"):
        HotRowCache(V, D, capacity=0)
