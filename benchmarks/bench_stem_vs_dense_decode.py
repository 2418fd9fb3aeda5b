"""P6: decode speed of STEM vs dense on the same backbone, and what the table store moves.

1. Decode tokens/s of STEM-1/2 (tables in RAM) ÷ dense on the mobilellm-350m backbone, next to the
   ratio of parameter bytes loaded per decoded token (``stemlm.accounting.decode_param_bytes``):
   decoding is memory-bound, so the speed ratio should follow the inverse of the byte ratio.
   Decode speed on this shared CPU swings by ±15 % between back-to-back runs of a few seconds, so
   the ratio is the median of per-round ratios over ``--decode-rounds`` (default 10) alternating
   rounds.
2. Prefill throughput with the tables on disk, with and without prefetch overlap (the rows of all
   layers gathered by the worker thread while layer 0.. compute), plus the time of the gather alone.
3. Bytes moved per step (store statistics) vs the formula ``tables · uniq(B·L) · d_ff · bytes``.

Random weights; the STEM checkpoint and tables file are shared with ``bench_offload_decode.py``.

    python benchmarks/bench_stem_vs_dense_decode.py
    python benchmarks/bench_stem_vs_dense_decode.py --quick
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch
from _store_bench import bench_checkpoint, timed_decode, use_matmul
from _train_bench import paired_ratio, round_ratios, write_result, zipf_tokens

from stemlm import StemLM, model_config
from stemlm.accounting import decode_param_bytes
from stemlm.runtime.artifacts import cache_dir
from stemlm.cli.options import add_matmul_argument
from stemlm.store import Placement, open_model


def decode_speeds(models: dict, prompt: torch.Tensor, new_tokens: int, rounds: int) -> dict[str, list[float]]:
    """Decode tokens/s of each model per round; rounds interleaved (the order alternates) so the
    machine's slow phases hit every model alike."""
    for m in models.values():
        timed_decode(m, prompt[:, :4], 4)  # warm-up
    speeds = {k: [] for k in models}
    for r in range(rounds):
        for name in (list(models) if r % 2 == 0 else list(models)[::-1]):
            tokens, _, t = timed_decode(models[name], prompt, new_tokens, seed=r)
            speeds[name].append((len(tokens) - 1) / t)
    return speeds


def prefill_overlap(ckpt, tables, ids: torch.Tensor, rounds: int, matmul: str) -> dict:
    """Prefill tokens/s on the disk tier with and without prefetch, the gather time alone, and the
    bytes moved per forward vs the ``tables · uniq · d_ff · 4`` formula."""
    models = {p: open_model(ckpt, Placement("disk", tables_file=tables, prefetch=p)) for p in (False, True)}
    runs = {p: (model, model.tables) for p, model in models.items()}
    for model, _ in runs.values():
        use_matmul(model, matmul)
    cfg = runs[True][0].cfg
    times = {False: [], True: []}
    gather = []
    with torch.no_grad():
        for r in range(rounds + 1):
            for p, (model, store) in runs.items():
                store.reset_stats()
                t0 = time.perf_counter()
                model(ids, table_rows=store.prefetch(ids))  # no ticket without prefetch: gathered in the forward
                if r:  # round 0 warms up
                    times[p].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            uniq = torch.unique(ids)
            for t in runs[False][0].tables.values():
                t.fetch(uniq)
            if r:
                gather.append(time.perf_counter() - t0)
    stats = runs[True][1].stats()
    runs[False][1].reset_stats()
    with torch.no_grad():
        runs[False][0](ids)
    formula = len(cfg.table_layers) * len(torch.unique(ids)) * cfg.d_ff * 4
    tok = ids.numel()
    t_sync, t_pre, t_gather = (statistics.median(x) for x in (times[False], times[True], gather))
    return {"batch": list(ids.shape), "unique_ids": int(len(torch.unique(ids))),
            "prefill_tokens_per_s_sync": tok / t_sync, "prefill_tokens_per_s_prefetch": tok / t_pre,
            "speedup_prefetch": t_sync / t_pre, "gather_all_layers_s": t_gather, "forward_sync_s": t_sync,
            "gather_hidden_fraction": (t_sync - t_pre) / t_gather if t_gather else None,
            "stalls_last_forward": stats["stalls"], "bytes_moved_per_step": runs[False][1].stats()["bytes_moved"],
            "bytes_formula": formula, "bytes_ratio": runs[False][1].stats()["bytes_moved"] / formula}


def decode_bytes(ckpt, tables, prompt: torch.Tensor, new_tokens: int, matmul: str) -> dict:
    """Bytes moved per decode step (disk tier, no cache) vs one row per table per new token."""
    model = open_model(ckpt, Placement("disk", tables_file=tables))
    store = model.tables
    use_matmul(model, matmul)
    timed_decode(model, prompt, 2)
    store.reset_stats()
    tokens, _, _ = timed_decode(model, prompt, new_tokens)
    s = store.stats()
    cfg = model.cfg
    steps = len(tokens) - 1  # decode forwards after the prefill
    prefill = len(torch.unique(prompt)) * len(cfg.table_layers) * cfg.d_ff * 4
    per_step = (s["bytes_moved"] - prefill) / steps
    return {"bytes_per_decode_step": per_step, "formula_per_step": len(cfg.table_layers) * cfg.d_ff * 4,
            "ratio": per_step / (len(cfg.table_layers) * cfg.d_ff * 4)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="mobilellm-350m", help="backbone shape (default mobilellm-350m)")
    ap.add_argument("--stem-layers", default="1/2", help="STEM placement (default 1/2)")
    ap.add_argument("--new-tokens", type=int, default=32, help="decoded tokens per round (default 32)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved prefill timing rounds (default 3)")
    ap.add_argument("--decode-rounds", type=int, default=10,
                    help="interleaved decode rounds; the speed ratio is the median of per-round ratios (default 10)")
    ap.add_argument("--prefill", default="1x512,4x256", help="prefill batch shapes BxL (default 1x512,4x256)")
    add_matmul_argument(ap)
    ap.add_argument("--quick", action="store_true", help="tiny shape, few tokens; writes stem_vs_dense_decode.quick.json")
    args = ap.parse_args()
    if args.quick:
        args.preset, args.new_tokens, args.rounds, args.decode_rounds, args.prefill = "tiny", 6, 1, 1, "1x64,2x32"
    cfg = model_config(args.preset, ffn="stem", stem_layers=args.stem_layers)
    dense_cfg = cfg.replace(ffn="dense")
    ckpt, tables = bench_checkpoint(cfg, cache_dir() / "bench" / "offload")
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, cfg.vocab_size, (1, 32 if not args.quick else 8), generator=gen)

    stem = use_matmul(open_model(ckpt, Placement("device", tables_file=tables)), args.matmul)
    torch.manual_seed(0)
    dense = use_matmul(StemLM(dense_cfg).eval(), args.matmul)
    rounds = decode_speeds({"stem": stem, "dense": dense}, prompt, args.new_tokens, args.decode_rounds)
    speeds = {k: statistics.median(v) for k, v in rounds.items()}
    del stem, dense
    gc.collect()
    byte_ratio = decode_param_bytes(cfg, 4) / decode_param_bytes(dense_cfg, 4)
    ratio = paired_ratio(rounds["stem"], rounds["dense"])
    decode = {"tokens_per_s": speeds, "tokens_per_s_rounds": rounds, "speed_ratio_stem_over_dense": ratio,
              "speed_ratio_rounds": round_ratios(rounds["stem"], rounds["dense"]),
              "speed_ratio_of_medians": speeds["stem"] / speeds["dense"],
              "param_bytes_per_token": {"stem": decode_param_bytes(cfg, 4), "dense": decode_param_bytes(dense_cfg, 4)},
              "param_bytes_ratio_stem_over_dense": byte_ratio, "inverse_bytes_ratio": 1 / byte_ratio}
    print(f"decode: STEM {speeds['stem']:.2f} tok/s, dense {speeds['dense']:.2f} tok/s (medians), ratio "
          f"{ratio:.3f} (median of per-round ratios {', '.join(f'{x:.2f}' for x in decode['speed_ratio_rounds'])}; "
          f"of medians {decode['speed_ratio_of_medians']:.3f}) (dense/STEM parameter bytes per token: {1 / byte_ratio:.3f})")

    prefill = {}
    for shape in args.prefill.split(","):
        B, L = (int(x) for x in shape.lower().split("x"))
        ids = torch.from_numpy(zipf_tokens(B * L, cfg.vocab_size, seed=1)).view(B, L)
        prefill[shape] = p = prefill_overlap(ckpt, tables, ids, args.rounds, args.matmul)
        print(f"prefill {shape}: {p['prefill_tokens_per_s_sync']:.0f} tok/s sync, {p['prefill_tokens_per_s_prefetch']:.0f} "
              f"with prefetch (x{p['speedup_prefetch']:.3f}); gather {p['gather_all_layers_s'] * 1e3:.1f} ms of "
              f"{p['forward_sync_s'] * 1e3:.0f} ms; bytes/formula {p['bytes_ratio']:.3f}")
    dec_bytes = decode_bytes(ckpt, tables, prompt, args.new_tokens, args.matmul)
    print(f"decode bytes per step: {dec_bytes['bytes_per_decode_step']:.0f} (formula {dec_bytes['formula_per_step']})")
    path = write_result("stem_vs_dense_decode", args.quick, {
        "config": {"preset": args.preset, "stem_layers": args.stem_layers, "tables": len(cfg.table_layers),
                   "new_tokens": args.new_tokens, "rounds": args.rounds, "decode_rounds": args.decode_rounds, "matmul": args.matmul},
        "decode": decode, "prefill_disk_tier": prefill, "decode_bytes_disk_tier": dec_bytes})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
