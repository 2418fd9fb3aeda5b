"""P5: hit rate of the LFU hot-row cache vs its capacity on the real corpus token stream.

The stream is the validation split of the default corpus (BoolQ Wikipedia passages; built once
with ``stemlm data prepare`` if missing), fed one token per lookup as in decoding, under two
tokenizers: the project's BPE (4096 ids) and the real SmolLM2 tokenizer (49152 ids, from the
pinned GGUF; the same documents re-tokenized, train counts too). The hit rate at a fixed fraction
of rows depends strongly on the vocabulary size: a small vocabulary has a flat head. Capacity is
1 / 5 / 10 / 20 % of the vocabulary rows. Policies side by side:

* ``lfu_cold``: the cache starts empty, counts grow online;
* ``lfu_warm``: counts and contents warm-started from ``train.counts.npy`` (training-split frequencies);
* ``window_cold`` / ``window_warm``: the same with a 10 % LRU admission window (W-TinyLFU,
  ``HotRowCache(window=0.1)``);
* ``static_oracle``: the best *fixed* set of rows for this stream (its own top-k), an upper bound
  for any static cache;
* ``belady_cold``: Belady's clairvoyant optimum from an empty cache (evict the row needed furthest
  in the future), an upper bound for any demand-filled cache that starts empty.

Goal: >= 90% hits at 10% of the rows. Writes ``results/cache_hit.json`` and ``cache_hit.png``.

    python benchmarks/bench_cache_hit.py
    python benchmarks/bench_cache_hit.py --quick      # first 3000 tokens
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch
from _train_bench import RESULTS, write_result
from tqdm import tqdm

from stemlm.store import HotRowCache

FRACTIONS = (0.01, 0.05, 0.10, 0.20)


def corpus_dir():
    from stemlm.data import default_data_dir, is_complete, prepare_default_corpus

    data_dir = default_data_dir()
    if not is_complete(data_dir):
        prepare_default_corpus(data_dir)
    return data_dir


def corpus_stream(split: str, max_docs: int = 0):
    """``(tokens, train_counts, vocab_size)`` of the default corpus with its own tokenizer."""
    from stemlm.data import TokenDataset

    data_dir = corpus_dir()
    ds = TokenDataset.open(data_dir, split)
    counts = np.load(data_dir / "train.counts.npy")
    return np.asarray(ds.tokens, dtype=np.int64), counts, ds.vocab_size


def _documents(split: str, max_docs: int) -> list[list[int]]:
    from stemlm.data import TokenDataset

    ds = TokenDataset.open(corpus_dir(), split)
    starts = list(ds.doc_starts[:max_docs or None]) + [len(ds.tokens) if not max_docs or max_docs >= ds.n_docs
                                                       else ds.doc_starts[max_docs]]
    return [np.asarray(ds.tokens[a:b]).tolist() for a, b in zip(starts[:-1], starts[1:])]


def smollm2_stream(split: str, max_docs: int = 0):
    """The same documents re-tokenized with the SmolLM2 tokenizer (EOS between documents)."""
    from stemlm.data.codec import load_codec
    from stemlm.interop.convert import resolve_source
    from stemlm.data import load_tokenizer as load_bpe

    bpe = load_bpe(corpus_dir())
    directory, gguf = resolve_source("smollm2")
    tok = load_codec(tokenizer=directory, prefer="transformers", gguf_file=gguf).tokenizer

    def encode(docs):
        texts = [bpe.decode(d, skip_special_tokens=True) for d in docs]
        ids = tok(texts, add_special_tokens=False)["input_ids"]
        return np.concatenate([np.array([tok.eos_token_id] + x, dtype=np.int64) for x in ids])

    stream = encode(_documents(split, max_docs))
    counts = np.bincount(encode(_documents("train", max_docs * 10)), minlength=len(tok))
    return stream, counts, len(tok)


STREAMS = {"corpus": corpus_stream, "smollm2": smollm2_stream}
POLICIES = ("lfu_cold", "lfu_warm", "window_cold", "window_warm")  # the online policies of HotRowCache


WINDOW = 0.1


def lfu_hit_rate(tokens: np.ndarray, vocab: int, capacity: int, per_lookup: int, warm_counts=None,
                 window: float = 0.0) -> dict:
    """Replay ``tokens`` through a ``HotRowCache`` (rows of width 1), ``per_lookup`` tokens per lookup."""
    cache = HotRowCache(vocab, 1, capacity, window=window)
    load = lambda ids: torch.zeros(len(ids), 1)  # noqa: E731 (the values do not matter here)
    if warm_counts is not None:
        cache.warm(warm_counts, load)
    ids = torch.from_numpy(tokens)
    for a in range(0, len(ids), per_lookup):
        cache.fetch(torch.unique(ids[a:a + per_lookup]), load)
    return cache.stats()


def static_oracle(tokens: np.ndarray, vocab: int, capacity: int) -> float:
    """Token fraction covered by the stream's own ``capacity`` most frequent ids."""
    counts = np.bincount(tokens, minlength=vocab)
    return float(np.sort(counts)[::-1][:capacity].sum() / counts.sum())


def belady_hit_rate(tokens: np.ndarray, capacity: int) -> float:
    """Hit rate of Belady's optimal replacement (one token per lookup) from an empty cache."""
    import heapq

    n = len(tokens)
    next_use = np.empty(n, dtype=np.int64)
    seen: dict[int, int] = {}
    for i in range(n - 1, -1, -1):
        t = int(tokens[i])
        next_use[i] = seen.get(t, n + t)  # never again: beyond the end (distinct per id)
        seen[t] = i
    resident: dict[int, int] = {}  # id -> its next use
    heap: list[tuple[int, int]] = []  # (-next use, id); stale entries skipped
    hits = 0
    for i in range(n):
        t = int(tokens[i])
        if t in resident:
            hits += 1
        elif len(resident) >= capacity:
            while True:
                neg, victim = heapq.heappop(heap)
                if resident.get(victim) == -neg:
                    break
            del resident[victim]
        resident[t] = int(next_use[i])
        heapq.heappush(heap, (-resident[t], t))
    return hits / n


def replot(path_json, path_png) -> None:
    """Redraw the PNG from a results JSON (no replay)."""
    import json

    res = json.loads(Path(path_json).read_text())
    plot(res["streams"], path_png, res["config"]["split"])


def plot(results: dict, path, split: str = "val") -> None:
    """Hit rate vs capacity: colour = policy, line style = tokenizer; W-TinyLFU cold only without warm runs."""
    from stemlm.runtime.plotting import pyplot, save

    plt = pyplot()

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    styles = {"lfu_cold": ("o", "LFU cold"), "lfu_warm": ("s", "LFU warm (train counts)"),
              "window_warm": ("D", "W-TinyLFU warm"), "static_oracle": ("^", "static top-k bound"),
              "belady_cold": ("v", "Belady optimum, cold"), "window_cold": ("P", "W-TinyLFU cold")}
    colors = dict(zip(styles, ("tab:blue", "tab:orange", "tab:green", "tab:grey", "tab:purple", "tab:red")))
    for (name, res), ls in zip(results.items(), ("-", "--", ":")):  # line style: stream; colour: policy
        x = [100 * r["fraction"] for r in res["rows"]]
        for key, (marker, label) in styles.items():
            first = res["rows"][0]
            if first.get(key) is None or (key == "window_cold" and first.get("window_warm") is not None):
                continue
            ax.plot(x, [100 * r[key] for r in res["rows"]], ls=ls, marker=marker, color=colors[key],
                    label=f"{label}, {name} (V={res['vocab_size']})")
    ax.axhline(90, color="grey", ls="--", lw=1)
    ax.axvline(10, color="grey", ls=":", lw=1)
    ax.set_xlabel("cache capacity (% of the vocabulary rows)")
    ax.set_ylabel("hit rate (%)")
    stream = {"val": "validation", "train": "training"}.get(split, split)
    ax.set_title(f"Hot-row cache hit rate, {stream} token stream (decode order)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    save(fig, path, dpi=120)


def sweep(tokens: np.ndarray, counts: np.ndarray | None, vocab: int, per_lookup: int) -> list[dict]:
    """Hit rates of every policy at every capacity fraction (warm policies are None without ``counts``)."""
    rows = []
    for frac in tqdm(FRACTIONS, desc="capacities", leave=False):
        cap = max(1, round(frac * vocab))
        cold = lfu_hit_rate(tokens, vocab, cap, per_lookup)
        wcold = lfu_hit_rate(tokens, vocab, cap, per_lookup, window=WINDOW)
        none = {"hit_rate": None, "evictions": None}  # no warm start: the counts would include the stream
        warm = lfu_hit_rate(tokens, vocab, cap, per_lookup, warm_counts=counts) if counts is not None else none
        wwarm = (lfu_hit_rate(tokens, vocab, cap, per_lookup, warm_counts=counts, window=WINDOW)
                 if counts is not None else none)
        rows.append({"fraction": frac, "capacity_rows": cap, "lfu_cold": cold["hit_rate"], "lfu_warm": warm["hit_rate"],
                     "window_cold": wcold["hit_rate"], "window_warm": wwarm["hit_rate"],
                     "static_oracle": static_oracle(tokens, vocab, cap),
                     "belady_cold": belady_hit_rate(tokens, cap) if per_lookup == 1 else None,
                     "evictions_cold": cold["evictions"], "evictions_warm": warm["evictions"]})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--split", default="val",
                    help="token split to replay (default val); 'train' (a longer stream) runs cold policies only and "
                         "writes cache_hit_train.json/png")
    ap.add_argument("--streams", default="corpus,smollm2", help="comma list of tokenizations: corpus, smollm2")
    ap.add_argument("--tokens-per-lookup", type=int, default=1, help="tokens per lookup (1 = decoding; default 1)")
    ap.add_argument("--max-tokens", type=int, default=0, help="replay only the first N tokens (default: all)")
    ap.add_argument("--quick", action="store_true", help="first 3000 tokens; writes cache_hit.quick.json/png")
    args = ap.parse_args()
    limit = 3000 if args.quick else args.max_tokens
    results = {}
    for name in args.streams.split(","):
        tokens, counts, vocab = STREAMS[name](args.split, 20 if args.quick else 0)
        tokens = tokens[:limit] if limit else tokens
        counts = counts if args.split != "train" else None  # training counts would know the stream
        rows = sweep(tokens, counts, vocab, args.tokens_per_lookup)
        at10 = next(r for r in rows if r["fraction"] == 0.10)
        n_unique = int(len(np.unique(tokens)))
        results[name] = {"vocab_size": vocab, "tokens": int(len(tokens)), "unique_tokens": n_unique,
                         "cold_start_bound": 1 - n_unique / len(tokens),  # every first occurrence misses a cold cache
                         "rows": rows, "hit_rate_at_10pct": {k: at10[k] for k in POLICIES},
                         "goal_0.9_at_10pct": max(at10[k] or 0 for k in POLICIES) >= 0.9}
        for r in rows:
            f3 = lambda x: "  -  " if x is None else f"{x:.3f}"  # noqa: E731
            print(f"{name:>8} V={vocab:6d} {100 * r['fraction']:4.0f}% ({r['capacity_rows']:5d} rows): LFU cold "
                  f"{f3(r['lfu_cold'])} warm {f3(r['lfu_warm'])} | W-TinyLFU cold {f3(r['window_cold'])} warm "
                  f"{f3(r['window_warm'])} | static bound {r['static_oracle']:.3f}"
                  + (f"  Belady cold {r['belady_cold']:.3f}" if r["belady_cold"] is not None else ""))
    name = "cache_hit" if args.split == "val" else f"cache_hit_{args.split}"
    png = RESULTS / f"{name}{'.quick' if args.quick else ''}.png"
    RESULTS.mkdir(parents=True, exist_ok=True)
    plot(results, png, args.split)
    path = write_result(name, args.quick, {
        "config": {"corpus": str(corpus_dir()), "split": args.split, "tokens_per_lookup": args.tokens_per_lookup,
                   "fractions": list(FRACTIONS)}, "streams": results, "plot": png.name})
    print(f"goal >= 0.90 at 10%: " + ", ".join(f"{k}: {v['goal_0.9_at_10pct']}" for k, v in results.items()))
    print(f"wrote {path} and {png}")


if __name__ == "__main__":
    main()
