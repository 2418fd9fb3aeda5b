"""Shared by the table-store benchmarks: resident memory, a random checkpoint with its tables in a
separate file (cached), and timed decoding."""

from __future__ import annotations

import hashlib
import json
import math
import time
from pathlib import Path

import torch
import torch.nn as nn


def proc_status() -> dict[str, int]:
    """Resident memory of this process in bytes, from ``/proc/self/status``."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"):
                out[key] = int(rest.split()[0]) * 1024
    return out


def stem_bench_model(args, name: str):
    """``(cfg, ckpt_dir, tables_file)`` of ``args.preset`` with STEM at ``args.stem_layers`` (cached under
    ``bench/<name>``), after applying ``args.threads`` (0 = torch's choice)."""
    from stemlm import model_config
    from stemlm.runtime.artifacts import cache_dir

    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = model_config(args.preset, ffn="stem", stem_layers=args.stem_layers)
    return (cfg, *bench_checkpoint(cfg, cache_dir() / "bench" / name))


def bench_checkpoint(cfg, root: Path, seed: int = 0) -> tuple[Path, Path]:
    """``(ckpt_dir, tables_file)`` of a random model of shape ``cfg``, created once under ``root``.

    The checkpoint holds every weight but the tables; the tables (fp32, the config's init std)
    are streamed into ``tables.safetensors`` one chunk at a time, so no table is ever whole in RAM.
    """
    from tqdm import tqdm

    from stemlm.checkpoint.directory import write_model_files
    from stemlm.runtime.files import atomic_directory
    from stemlm.model.decoder import StemLM
    from stemlm.checkpoint.safetensors_io import write_safetensors
    from stemlm.store import table_key

    tag = hashlib.sha256(json.dumps({**cfg.to_dict(), "seed": seed}, sort_keys=True).encode()).hexdigest()[:12]
    out = root / f"model-{tag}"
    if (out / "COMPLETE").exists():
        return out / "ckpt", out / "tables.safetensors"
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = StemLM(cfg)
    model.tables = nn.ModuleDict()  # the tables go to their own file below
    model.to_empty(device="cpu")
    if cfg.tie_embeddings:
        model.lm_head.weight = model.tok_embeddings.weight
    model.reset_parameters()
    with atomic_directory(out) as tmp:
        (tmp / "ckpt").mkdir()
        write_model_files(model, tmp / "ckpt")
        gen = torch.Generator().manual_seed(seed + 1)
        rows = {i: cfg.table_rows(i) for i in cfg.table_layers}  # V, or ngram_slots for an n-gram table
        total = sum(rows.values()) * cfg.d_ff * 4
        with tqdm(total=total, unit="B", unit_scale=True, desc="random tables") as bar:
            # xavier_normal, the default table init: std = sqrt(2 / (rows + d_ff))
            specs = [(table_key(i), torch.float32, (n, cfg.d_ff),
                      lambda a, b, std=math.sqrt(2.0 / (n + cfg.d_ff)): torch.randn(b - a, cfg.d_ff, generator=gen) * std)
                     for i, n in rows.items()]
            write_safetensors(tmp / "tables.safetensors", specs, progress=bar.update)
        (tmp / "COMPLETE").write_text("ok")
    return out / "ckpt", out / "tables.safetensors"


def use_matmul(model, name: str):
    """``model`` with its linears on the GEMM backend ``name`` (auto | aten | onednn), as
    ``stemlm generate --matmul`` does; returns the model."""
    from stemlm.runtime.matmul import apply_matmul

    apply_matmul(model, name)
    return model


def drop_page_cache(path: Path) -> None:
    """Ask the kernel to drop a file's clean pages from the page cache (no root needed)."""
    import os

    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def timed_decode(model, prompt: torch.Tensor, new_tokens: int, seed: int = 0, temperature: float = 1.0):
    """``(tokens, seconds_prefill, seconds_decode)`` of one generation (sampled, seeded)."""
    from stemlm.inference.generate import generate

    t0 = time.perf_counter()
    it = generate(model, prompt, new_tokens, temperature=temperature, seed=seed)
    tokens = [int(next(it)[0])]  # the first token comes out of the prefill
    t1 = time.perf_counter()
    tokens += [int(t[0]) for t in it]
    return tokens, t1 - t0, time.perf_counter() - t1
