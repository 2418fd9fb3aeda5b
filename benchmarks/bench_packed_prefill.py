"""Packed against right-padded prefill: one batch of prompts of mixed lengths, time to first token and to the end.

The model is the tiny preset with STEM in every third layer and random weights, tables on the host
tier (``_store_bench.stem_bench_model``), as in ``bench_batch_decode.py``. One batch of ``--batch``
prompts whose lengths cycle through ``--prompt-lens`` is decoded with ``generate_batch`` twice per
round, back to back in alternating order: with the decode core's packed prefill
(``stemlm.inference.core.pack_prompts``: prompts of unequal length share rows of the prefill forward)
and with every prompt in a row of its own, right-padded to the longest (the prefill before
2026-11-28). Measured for ``max_new_tokens`` = 1 (the prefill and the first token) and
``--new-tokens`` (the whole request). Ratio = packed ÷ padded wall time, median over ``--repeats``
rounds of the per-round ratio; the tokens of the two ways must be equal.

    python benchmarks/bench_packed_prefill.py             # 16 prompts of 8..64 tokens, 9 rounds
    python benchmarks/bench_packed_prefill.py --quick     # 4 prompts, 2 rounds
"""

from __future__ import annotations

import argparse
import time

import torch
from _store_bench import stem_bench_model
from _train_bench import paired_ratio, round_ratios, write_result

from stemlm.inference import core
from stemlm.inference.batch_generate import SamplingParams, generate_batch
from stemlm.store import Placement, open_model


def one_row_each(lengths, width):
    """The layout before packing: every prompt in a row of its own."""
    return [[j] for j in range(len(lengths))]


def timed(model, prompts, new_tokens: int, packed: bool) -> tuple[float, list[list[int]]]:
    """Wall seconds of one ``generate_batch`` and its tokens, with or without packing."""
    layout = core.pack_prompts
    core.pack_prompts = layout if packed else one_row_each
    try:
        params = [SamplingParams(new_tokens, temperature=1.0, seed=i) for i in range(len(prompts))]
        t0 = time.perf_counter()
        out = generate_batch(model, prompts, params)
        return time.perf_counter() - t0, out
    finally:
        core.pack_prompts = layout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny", help="model shape (default tiny)")
    ap.add_argument("--stem-layers", default="1/3", help="STEM placement (default 1/3)")
    ap.add_argument("--batch", type=int, default=16, help="prompts in the batch (default 16)")
    ap.add_argument("--prompt-lens", default="8,32,16,64,24,48,12,40", help="prompt lengths, cycled")
    ap.add_argument("--new-tokens", type=int, default=32, help="tokens generated per prompt (default 32)")
    ap.add_argument("--repeats", type=int, default=9, help="paired rounds (default 9)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    ap.add_argument("--seed", type=int, default=0, help="seed of weights and prompts (default 0)")
    ap.add_argument("--quick", action="store_true", help="4 prompts, 4 new tokens, 2 rounds")
    args = ap.parse_args()
    if args.quick:
        args.batch, args.new_tokens, args.repeats = 4, 4, 2
    cfg, ckpt, tables = stem_bench_model(args, "packed_prefill")
    model = open_model(ckpt, Placement("host", tables_file=tables))
    lens = [int(x) for x in args.prompt_lens.split(",")][:args.batch]
    lens = [lens[i % len(lens)] for i in range(args.batch)]
    g = torch.Generator().manual_seed(args.seed)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in lens]
    rows = len(core.pack_prompts(lens, max(lens)))
    results = {}
    for name, new in (("first_token", 1), ("whole", args.new_tokens)):
        timed(model, prompts, new, True), timed(model, prompts, new, False)  # warm-up
        packed, padded, same = [], [], True
        for r in range(args.repeats):
            order = (True, False) if r % 2 == 0 else (False, True)
            got = {p: timed(model, prompts, new, p) for p in order}
            packed.append(got[True][0])
            padded.append(got[False][0])
            same &= got[True][1] == got[False][1]
        ratio = paired_ratio(packed, padded)
        results[name] = {"max_new_tokens": new, "packed_s": packed, "padded_s": padded, "ratio": ratio,
                         "round_ratios": round_ratios(packed, padded), "same_tokens": same}
        print(f"{name} (max_new_tokens {new}): packed / padded {ratio:.3f} (rounds "
              f"{min(results[name]['round_ratios']):.3f} ... {max(results[name]['round_ratios']):.3f}), "
              f"same tokens {same}")
    path = write_result("packed_prefill", args.quick, {
        "config": {"preset": args.preset, "stem_layers": args.stem_layers, "tier": "host", "prompt_lens": lens,
                   "prefill_rows_packed": rows, "prefill_rows_padded": len(lens),
                   "tokens_packed": rows * max(lens), "tokens_padded": len(lens) * max(lens), "repeats": args.repeats},
        **results})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
