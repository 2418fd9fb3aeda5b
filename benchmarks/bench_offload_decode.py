"""P4: decode speed and resident memory with the STEM tables on disk vs in RAM.

The model is the mobilellm-350m shape with STEM in every second layer (16 tables of 32000 × 2560
fp32 = 5.24 GB) and random weights; the checkpoint and a separate tables file are generated once
into the stemlm cache. Each tier runs in its own subprocess (so its resident set is clean) and
reports JSON: the same seeded sampled generations (``--gens``, 3 by default) on every tier, timed
per decode step.

Decode timing on this shared CPU varies by up to 40 % between runs of a minute, so the runs are
repeated in interleaved rounds (``--repeats``, default 5; the order of the runs rotates from round
to round). The speed ratio is the median over rounds of disk ÷ RAM within a round (slow phases of
the machine move whole rounds and cancel in each ratio); the ratio of the runs' median speeds is
reported next to it.

Goals: disk ÷ RAM decode tokens/s >= 0.95, and resident memory lower by >= 90% of the table bytes.
``disk-cold`` drops the tables file from the page cache (``posix_fadvise``) before each
generation, so every row touched is read from the device.

    python benchmarks/bench_offload_decode.py                # the real run (lead)
    python benchmarks/bench_offload_decode.py --quick        # tiny shape, seconds

Tables larger than RAM (no in-memory reference can run; writes ``offload_decode_<preset>.json``):

    python benchmarks/bench_offload_decode.py --preset llama3.2-1b --stem-layers 1/2 \
        --runs disk-cold --repeats 1 --new-tokens 16
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from _store_bench import bench_checkpoint, drop_page_cache, proc_status, timed_decode, use_matmul
from _train_bench import paired_ratio, rotated, round_ratios, write_result

from stemlm import model_config
from stemlm.runtime.artifacts import cache_dir
from stemlm.cli.options import add_matmul_argument
from stemlm.store import Placement, open_model

RUNS = {"device": ("device", False), "host": ("host", False), "disk": ("disk", False), "disk-cold": ("disk", True)}


def worker(args) -> dict:
    """One tier in this process: load, warm up, time decoding; resident memory before/after."""
    torch.set_num_threads(args.threads) if args.threads else None
    base = proc_status()
    tier, cold = RUNS[args.worker]
    if cold:
        drop_page_cache(Path(args.tables))
    model = open_model(args.ckpt, Placement(tier, tables_file=args.tables, cache_rows=args.cache_rows))
    store = model.tables
    use_matmul(model, args.matmul)
    loaded = proc_status()
    gen = torch.Generator().manual_seed(args.seed)
    prompt = torch.randint(0, model.cfg.vocab_size, (1, args.prompt_len), generator=gen)
    timed_decode(model, prompt[:, :4], 4, seed=args.seed + 1)  # warm-up (allocator, kernels)
    store.reset_stats()
    tokens, t_prefill, t_decode = [], [], 0.0
    for g in range(args.gens):  # each generation samples other tokens: mostly rows not read yet
        if cold:
            drop_page_cache(Path(args.tables))
        toks, t_p, t_d = timed_decode(model, prompt, args.new_tokens, seed=args.seed + 100 * g)
        tokens.append(toks)
        t_prefill.append(t_p)
        t_decode += t_d
    after = proc_status()
    stats = {k: v for k, v in store.stats().items() if k != "per_table"}
    return {"run": args.worker, "tier": tier, "cold_page_cache": cold, "tokens": tokens,
            "decode_tokens_per_s": sum(len(t) - 1 for t in tokens) / t_decode, "prefill_s": t_prefill,
            "rss_start": base, "rss_loaded": loaded, "rss_end": after, "store": stats}


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="mobilellm-350m", help="model shape (default mobilellm-350m)")
    ap.add_argument("--stem-layers", default="1/2", help="STEM placement (default 1/2: 16 of 32 layers)")
    ap.add_argument("--new-tokens", type=int, default=64, help="tokens decoded per tier (default 64)")
    ap.add_argument("--prompt-len", type=int, default=32, help="prompt tokens (default 32)")
    ap.add_argument("--gens", type=int, default=3,
                    help="timed generations per worker, each with its own seed (disk-cold drops the page cache "
                         "before each); speed = all their tokens ÷ all their decode time (default 3)")
    ap.add_argument("--runs", default="device,disk,disk-cold", help=f"comma list of {', '.join(RUNS)}")
    ap.add_argument("--cache-rows", type=int, default=0, help="hot-row cache per table for host/disk (default 0)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads per worker (default: torch's choice)")
    ap.add_argument("--seed", type=int, default=0, help="seed of weights, prompt and sampling")
    add_matmul_argument(ap)
    ap.add_argument("--repeats", type=int, default=5,
                    help="rounds over the runs, interleaved; speed ratios are medians of per-round ratios (default 5)")
    ap.add_argument("--quick", action="store_true", help="tiny shape, 8 tokens; writes offload_decode.quick.json")
    ap.add_argument("--worker", choices=list(RUNS), help=argparse.SUPPRESS)
    ap.add_argument("--ckpt", help=argparse.SUPPRESS)
    ap.add_argument("--tables", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.quick:
        args.preset, args.new_tokens, args.prompt_len, args.gens = "tiny", 8, 8, 1
    return args


def main() -> None:
    args = parse_args()
    if args.worker:
        print(json.dumps(worker(args)))
        return
    cfg = model_config(args.preset, ffn="stem", stem_layers=args.stem_layers)
    ckpt, tables = bench_checkpoint(cfg, cache_dir() / "bench" / "offload")
    table_bytes = sum(cfg.table_rows(i) for i in cfg.table_layers) * cfg.d_ff * 4  # fp32 rows of every table
    rounds: dict[str, list[dict]] = {run: [] for run in args.runs.split(",")}
    for i in range(1 if args.quick else args.repeats):  # interleaved: slow phases of the machine hit every tier
        order = rotated(rounds, i)  # no run always goes first
        for run in order:
            cmd = [sys.executable, __file__, "--worker", run, "--ckpt", str(ckpt), "--tables", str(tables),
                   "--preset", args.preset, "--new-tokens", str(args.new_tokens), "--prompt-len", str(args.prompt_len),
                   "--gens", str(args.gens),
                   "--cache-rows", str(args.cache_rows), "--threads", str(args.threads), "--seed", str(args.seed),
                   "--matmul", args.matmul]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode:
                raise SystemExit(f"worker {run} failed:\n{proc.stderr[-3000:]}")
            r = json.loads(proc.stdout.strip().splitlines()[-1])
            rounds[run].append(r)
            print(f"round {i + 1} {run:>10}: {r['decode_tokens_per_s']:7.2f} tok/s  RSS {r['rss_end']['VmRSS'] / 2**20:8.1f} MiB "
                  f"(anon {r['rss_end']['RssAnon'] / 2**20:.1f}, file {r['rss_end']['RssFile'] / 2**20:.1f})  "
                  f"rows moved {r['store'].get('rows_moved', 0)}, stalls {r['store'].get('stalls', 0)} "
                  f"({r['store'].get('stall_seconds', 0) * 1e3:.0f} ms)", flush=True)
    results = {}
    for run, rs in rounds.items():  # the round with the median speed stands for the run
        results[run] = sorted(rs, key=lambda r: r["decode_tokens_per_s"])[len(rs) // 2]
        results[run]["decode_tokens_per_s_rounds"] = [r["decode_tokens_per_s"] for r in rs]
    ref = results.get("device") or results.get("host")
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    summary = {}
    for run, r in results.items():
        if r["tier"] == "disk" and ref is not None:
            ref_speeds = ref["decode_tokens_per_s_rounds"]
            speed = paired_ratio(r["decode_tokens_per_s_rounds"], ref_speeds)
            per_round = round_ratios(r["decode_tokens_per_s_rounds"], ref_speeds)
            saved = ref["rss_end"]["VmRSS"] - r["rss_end"]["VmRSS"]
            summary[run] = {"speed_ratio_vs_ram": speed, "speed_ratio_rounds": per_round,
                            "speed_ratio_of_medians": r["decode_tokens_per_s"] / ref["decode_tokens_per_s"],
                            "rss_saved_bytes": saved, "rss_saved_over_table_bytes": saved / table_bytes,
                            "same_tokens_as_ram": r["tokens"] == ref["tokens"],
                            "goal_speed_0.95": speed >= 0.95, "goal_rss_0.9": saved >= 0.9 * table_bytes}
            print(f"{run}: speed {speed:.3f}x of RAM (median of per-round ratios "
                  f"{', '.join(f'{x:.2f}' for x in per_round)}; ratio of medians "
                  f"{summary[run]['speed_ratio_of_medians']:.3f}), RSS saved {saved / table_bytes:.1%} of the {table_bytes / 1e9:.2f} GB "
                  f"of tables, same tokens: {summary[run]['same_tokens_as_ram']}")
        elif r["tier"] == "disk":  # no in-memory reference, e.g. tables larger than RAM
            summary[run] = {"table_bytes_over_ram": table_bytes / ram, "rss_end_bytes": r["rss_end"]["VmRSS"],
                            "rss_peak_bytes": r["rss_end"]["VmHWM"]}
            print(f"{run}: {r['decode_tokens_per_s']:.2f} tok/s with {table_bytes / 1e9:.1f} GB of tables = "
                  f"{table_bytes / ram:.2f}x this machine's {ram / 2**30:.1f} GiB RAM; RSS {r['rss_end']['VmRSS'] / 2**30:.2f} GiB "
                  f"(peak {r['rss_end']['VmHWM'] / 2**30:.2f} GiB)")
    name = "offload_decode" if args.quick or args.preset == "mobilellm-350m" else f"offload_decode_{args.preset}"
    path = write_result(name, args.quick, {
        "config": {"preset": args.preset, "stem_layers": args.stem_layers, "tables": len(cfg.table_layers),
                   "vocab_size": cfg.vocab_size, "d_ff": cfg.d_ff, "table_bytes": table_bytes,
                   "new_tokens": args.new_tokens, "gens": args.gens, "prompt_len": args.prompt_len, "cache_rows": args.cache_rows,
                   "matmul": args.matmul, "repeats": len(next(iter(rounds.values()))), "ram_bytes": ram},
        "runs": results, "summary": summary})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
