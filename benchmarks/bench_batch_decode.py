"""Batched decode: tokens/s at batch 1, 4, 8, 16 with the STEM tables on host and on disk.

The model is the tiny preset with STEM in every third layer and random weights; the checkpoint and
a separate tables file are generated once into the stemlm cache (``_store_bench.bench_checkpoint``).
Each batch holds prompts of mixed lengths (``--prompt-lens``, cycled), each request samples with
its own seed (``batch_generate.SamplingParams``) and decodes ``--new-tokens`` tokens; request 0 is
the same in every batch, and whether its tokens equal those of batch 1 is reported.

Decode tokens/s = tokens produced after the prefill step ÷ the time from the first step to the
last. Rows: per decode step, the rows the table store looked up (``unique_rows`` of its stats,
per table) against the sum of each request's own rows (what decoding them one at a time would
fetch). Batch sizes run interleaved in rounds (``--repeats``; the order rotates each round), and
the speed ratio batch-8 ÷ batch-1 is the median over rounds of the per-round ratio.

Goal: batch 8 >= 4x the decode tokens/s of batch 1.

    python benchmarks/bench_batch_decode.py              # the real run (lead)
    python benchmarks/bench_batch_decode.py --quick      # batches 1 and 8, a few tokens

With ``--ckpt`` a trained checkpoint replaces the random model and the prompts are windows of its
validation text, so requests share tokens as real text does and the rows fetched per step fall below
the sum of each request's own (results in ``batch_decode_trained.json``).
"""

from __future__ import annotations

import argparse
import statistics
import time

from pathlib import Path

import torch
from _store_bench import stem_bench_model, use_matmul
from _train_bench import paired_ratio, rotated, round_ratios, write_result

from stemlm.inference.batch_generate import SamplingParams, decode_batch
from stemlm.cli.options import add_matmul_argument
from stemlm.checkpoint.directory import read_config
from stemlm.store import Placement, open_model


def prompts_for(batch: int, lens: list[int], vocab: int, seed: int, text=None) -> list[list[int]]:
    """``batch`` prompts; prompt ``i`` has length ``lens[i % len(lens)]`` and the same ids in every batch:
    random ids, or a window of ``text`` (token ids) at an offset fixed by ``seed + i``."""
    if text is not None:
        starts = [int(torch.randint(0, len(text) - 100, (), generator=torch.Generator().manual_seed(seed + i)))
                  for i in range(batch)]
        return [[int(t) for t in text[a:a + lens[i % len(lens)]]] for i, a in enumerate(starts)]
    return [torch.randint(0, vocab, (lens[i % len(lens)],), generator=torch.Generator().manual_seed(seed + i)).tolist()
            for i in range(batch)]


def timed_batch(model, store, prompts: list[list[int]], new_tokens: int, seed: int) -> dict:
    """Decode one batch; its tokens, decode speed and rows per decode step."""
    params = [SamplingParams(new_tokens, temperature=1.0, seed=seed + i) for i in range(len(prompts))]
    n_tables = len(store)
    out: list[list[int]] = [[] for _ in prompts]
    fetched, own, decoded = [], [], 0
    store.reset_stats()
    seen = 0
    t0 = time.perf_counter()
    t_first = None
    for k, step in enumerate(decode_batch(model, prompts, params)):
        for i, tok in zip(step.requests, step.tokens):
            out[i].append(tok)
        rows_now = store.stats()["unique_rows"]
        if k == 0:
            t_first = time.perf_counter()
        else:  # a decode step: the rows its forward looked up, per table
            decoded += len(step.tokens)
            fetched.append((rows_now - seen) / n_tables)
            own.append(step.request_rows)
        seen = rows_now
    t_end = time.perf_counter()
    return {"tokens": out, "prefill_s": t_first - t0, "decode_s": t_end - t_first, "decode_tokens": decoded,
            "decode_tokens_per_s": decoded / (t_end - t_first) if decoded else 0.0,
            "rows_per_step": statistics.mean(fetched) if fetched else 0.0,
            "request_rows_per_step": statistics.mean(own) if own else 0.0,
            "rows_fetched": sum(fetched), "request_rows": sum(own)}


def run_tier(args, ckpt, tables, tier: str, text=None) -> dict:
    """Every batch size on ``tier``, interleaved over rounds; the median round of each and the ratios."""
    model = open_model(ckpt, Placement(tier, tables_file=tables, cache_rows=args.cache_rows))
    store = model.tables
    use_matmul(model, args.matmul)
    lens = [int(x) for x in args.prompt_lens.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    timed_batch(model, store, prompts_for(2, lens, model.cfg.vocab_size, args.seed, text), 4, args.seed)  # warm-up
    rounds: dict[int, list[dict]] = {b: [] for b in batches}
    for r in range(args.repeats):
        for b in rotated(batches, r):
            res = timed_batch(model, store, prompts_for(b, lens, model.cfg.vocab_size, args.seed, text),
                              args.new_tokens, args.seed)
            rounds[b].append(res)
            print(f"{tier} round {r + 1} batch {b:>2}: {res['decode_tokens_per_s']:8.1f} tok/s, rows/step "
                  f"{res['rows_per_step']:.1f} vs {res['request_rows_per_step']:.1f} per request", flush=True)
    store.close()
    results = {}
    for b, rs in rounds.items():
        med = sorted(rs, key=lambda x: x["decode_tokens_per_s"])[len(rs) // 2]
        results[str(b)] = {**{k: v for k, v in med.items() if k != "tokens"},
                           "decode_tokens_per_s_rounds": [x["decode_tokens_per_s"] for x in rs],
                           "request0_same_tokens_as_batch1": med["tokens"][0] == rounds[batches[0]][0]["tokens"][0]}
    summary = {}
    if 1 in rounds and 8 in rounds:
        speeds8, speeds1 = ([x["decode_tokens_per_s"] for x in rounds[b]] for b in (8, 1))
        ratio = paired_ratio(speeds8, speeds1)
        summary = {"speed_ratio_b8_over_b1": ratio, "speed_ratio_rounds": round_ratios(speeds8, speeds1),
                   "goal_4x": ratio >= 4.0}
        print(f"{tier}: batch 8 = {ratio:.2f}x batch 1 (goal >= 4x)")
    return {"batches": results, "summary": summary}


def trained(args):
    """``(checkpoint, tables file or None, validation token ids)`` of ``args.ckpt``."""
    from stemlm.data import TokenDataset, default_data_dir
    from stemlm.checkpoint.directory import resolve_checkpoint
    from stemlm.train.evaluate import _stored_run_config

    if args.threads:
        torch.set_num_threads(args.threads)
    ckpt = resolve_checkpoint(args.ckpt)
    data = (_stored_run_config(ckpt).get("data") or {}).get("dir") or default_data_dir()
    return ckpt, None, TokenDataset.open(Path(data), "val").tokens


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny", help="model shape (default tiny)")
    ap.add_argument("--ckpt", default=None, help="a trained STEM checkpoint or run instead of the random model; "
                                                 "prompts from its validation text (writes batch_decode_trained.json)")
    ap.add_argument("--stem-layers", default="1/3", help="STEM placement (default 1/3)")
    ap.add_argument("--tiers", default="host,disk", help="comma list of table tiers (default host,disk)")
    ap.add_argument("--batches", default="1,4,8,16", help="batch sizes (default 1,4,8,16)")
    ap.add_argument("--prompt-lens", default="8,32,16,64,24,48,12,40",
                    help="prompt lengths, cycled over a batch (default 8,32,16,64,24,48,12,40)")
    ap.add_argument("--new-tokens", type=int, default=64, help="tokens decoded per request (default 64)")
    ap.add_argument("--cache-rows", type=int, default=0, help="hot-row cache per table (default 0)")
    ap.add_argument("--repeats", type=int, default=5, help="rounds over the batch sizes (default 5)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    ap.add_argument("--seed", type=int, default=0, help="seed of weights, prompts and sampling (default 0)")
    add_matmul_argument(ap)
    ap.add_argument("--quick", action="store_true",
                    help="batches 1,8, 4 tokens, 1 round; writes batch_decode.quick.json")
    args = ap.parse_args()
    if args.quick:
        args.batches, args.new_tokens, args.repeats, args.prompt_lens = "1,8", 4, 1, "3,9,5"
    return args


def main() -> None:
    args = parse_args()
    text = None
    if args.ckpt:
        ckpt, tables, text = trained(args)
        cfg = read_config(ckpt)
    else:
        cfg, ckpt, tables = stem_bench_model(args, "batch")
    tiers = {tier: run_tier(args, ckpt, tables, tier, text) for tier in args.tiers.split(",")}
    path = write_result("batch_decode_trained" if args.ckpt else "batch_decode", args.quick, {
        "config": {"preset": args.preset, "stem_layers": args.stem_layers, "tables": len(cfg.table_layers),
                   "checkpoint": str(ckpt) if args.ckpt else None, "prompts": "validation text" if args.ckpt else "random ids",
                   "batches": args.batches, "prompt_lens": args.prompt_lens, "new_tokens": args.new_tokens,
                   "cache_rows": args.cache_rows, "repeats": args.repeats, "matmul": args.matmul,
                   "sampling": "temperature 1.0, seed + request index"},
        "tiers": tiers})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
