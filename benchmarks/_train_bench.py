"""Shared by the training benchmarks: a synthetic Zipf data dir and a timed run of the real loop."""

from __future__ import annotations

import atexit
import json
import os
import re
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

# Where results go; tests point STEMLM_BENCH_RESULTS at a temporary directory.
RESULTS = Path(os.environ.get("STEMLM_BENCH_RESULTS") or Path(__file__).resolve().parent / "results")


def bench_work(default: Path) -> Path:
    """Where a benchmark keeps what it trains or converts (later runs reuse it): ``default``, or a folder of
    that name under ``$STEMLM_BENCH_WORK`` (``check.py`` gives every run a fresh one: each re-run trains and
    converts again instead of reading the last run's models)."""
    base = os.environ.get("STEMLM_BENCH_WORK")
    return Path(base) / default.name if base else default


def zipf_tokens(n: int, vocab: int, s: float = 1.1, seed: int = 0) -> np.ndarray:
    """``n`` token ids with Zipf(s) frequencies over ``1..vocab-1`` (0 is EOS)."""
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, vocab) ** s
    return rng.choice(np.arange(1, vocab), size=n, p=p / p.sum())


def synthetic_data_dir(vocab: int, n_tokens: int = 400_000, seed: int = 0) -> Path:
    """A prepared data dir of Zipf-distributed documents (cached per vocab/size in the temp dir)."""
    from stemlm.data import write_token_split

    out = Path(tempfile.gettempdir()) / f"stemlm-bench-data-v{vocab}-n{n_tokens}-s{seed}"
    if not (out / "meta.json").exists():
        toks = zipf_tokens(n_tokens, vocab, seed=seed)
        docs = np.array_split(toks, max(1, n_tokens // 500))
        write_token_split(out, "train", docs, vocab, 0)
        write_token_split(out, "val", docs[:20], vocab, 0)
    return out


def shape_overrides(vocab: int, batch_size: int, seq_len: int) -> list[str]:
    """The data and shape overrides of a training benchmark: synthetic Zipf data of ``vocab`` ids, ``batch_size``
    sequences of ``seq_len`` tokens a step, and a model long enough for them."""
    return [f"data.dir={synthetic_data_dir(vocab)}", f"data.batch_size={batch_size}", f"data.seq_len={seq_len}",
            f"model.max_seq_len={max(seq_len, 64)}"]


def make_trainer(overrides: list[str], preset: str = "tiny"):
    """A ``Trainer`` of the real training loop writing into a throw-away run dir (removed at exit)."""
    from stemlm.train import Trainer, load_train_config

    out = tempfile.mkdtemp(prefix="stemlm-bench-run-")
    atexit.register(shutil.rmtree, out, ignore_errors=True)
    cfg = load_train_config(preset, None, [f"run.out={out}", "run.progress=false", "run.plots=false",
                                           "run.peak_flops=1", *overrides])
    trainer = Trainer(cfg)
    trainer.peak_flops = 1.0
    return trainer


def preset_run_args(doc: str, name: str, steps: int, compile_option: bool = False):
    """Parsed ``--preset --batch-size --seq-len --steps --quick [model.FIELD=VALUE ...]`` of a benchmark
    on a model preset, plus the data/shape overrides for ``make_trainer`` (``--quick``: debug preset,
    tiny batches). ``args.result_name`` is ``name`` with the shape overrides appended.
    ``compile_option`` adds ``--compile`` (``args.compile``: also time the models with compiled blocks)."""
    import argparse

    from stemlm.presets import PRESETS

    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny", help="model shape (default: tiny)")
    ap.add_argument("--batch-size", type=int, default=16, help="sequences per step (default: 16)")
    ap.add_argument("--seq-len", type=int, default=256, help="tokens per sequence (default: 256)")
    ap.add_argument("--steps", type=int, default=steps, help=f"timed steps per model (default: {steps})")
    ap.add_argument("--quick", action="store_true", help=f"debug preset, 4x64 tokens, 2 steps; writes {name}.quick.json")
    if compile_option:
        ap.add_argument("--compile", action="store_true",
                        help="also time both models with run.compile=true (each block compiled), same rounds")
    ap.add_argument("overrides", nargs="*", metavar="model.FIELD=VALUE",
                    help="change the preset's shape, e.g. model.d_model=512 model.d_ff=1376; "
                         f"results go to {name}_<overrides>.json")
    args = ap.parse_args()
    bad = [o for o in args.overrides if not re.fullmatch(r"model\.\w+=\S+", o)]
    if bad:
        ap.error(f"overrides must look like model.FIELD=VALUE, got {bad}")
    args.result_name = "_".join([name, *(o.removeprefix("model.").replace("=", "") for o in args.overrides)])
    if args.quick:
        args.preset, args.batch_size, args.seq_len, args.steps = "debug", 4, 64, 2
    common = [*shape_overrides(PRESETS[args.preset]["vocab_size"], args.batch_size, args.seq_len), *args.overrides]
    return args, common


def time_interleaved(fns: dict, steps: int, warmup: int = 2, samples: dict | None = None) -> dict[str, float]:
    """Median seconds per call of each function, calls interleaved so machine noise hits all alike.
    ``samples`` (optional dict) receives every timed call's seconds, per function, in round order."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times = {k: [] for k in fns}
    for _ in range(steps):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    if samples is not None:
        samples.update(times)
    return {k: statistics.median(v) for k, v in times.items()}


def rotated(items, r: int) -> list:
    """``items`` started at position ``r`` (cyclically): round ``r``'s order, so no setting always runs first."""
    items = list(items)
    k = r % len(items)
    return items[k:] + items[:k]


def round_ratios(numer: list[float], denom: list[float]) -> list[float]:
    """``numer[i] / denom[i]`` for each round."""
    return [a / b for a, b in zip(numer, denom, strict=True)]


def paired_ratio(numer: list[float], denom: list[float]) -> float:
    """Median over rounds of ``numer[i] / denom[i]``: the two calls of a round ran back to back, so
    slow drifts of the machine's speed (which move whole rounds) cancel in each ratio."""
    return statistics.median(round_ratios(numer, denom))


def write_result(name: str, quick: bool, payload: dict) -> Path:
    """``results/<name>.json`` (``<name>.quick.json`` for smoke runs, never overwriting real results), with
    ``meta``: torch version, threads, machine, time and ``git_commit`` (``stemlm.version.git_commit`` of
    this checkout: short commit, ``-dirty`` when tracked files differ from it)."""
    import platform

    import torch

    from stemlm.version import git_commit

    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}{'.quick' if quick else ''}.json"
    meta = {"torch": torch.__version__, "threads": torch.get_num_threads(), "machine": platform.machine(),
            "processor": platform.processor(), "quick": quick, "time": time.strftime("%Y-%m-%d %H:%M:%S"),
            "git_commit": git_commit(Path(__file__).resolve().parent)}
    from stemlm.runtime.files import atomic_write_text

    atomic_write_text(path, json.dumps({"meta": meta, **payload}, indent=2))
    return path

