"""P3: model FLOP utilisation of the tiny preset, against a measured fp32 matmul peak.

MFU = (training FLOPs per token from stemlm.accounting × tokens/s) ÷ peak FLOP/s, where the peak
is the best fp32 ``n × n`` matmul throughput measured in the same process (the probe the training
loop uses for its ``mfu`` metric). Dense and STEM (1/3 of the layers) run the real loop.

    python benchmarks/bench_mfu.py
    python benchmarks/bench_mfu.py --quick
"""

from __future__ import annotations

from _train_bench import make_trainer, preset_run_args, time_interleaved, write_result

from stemlm.train.metrics import measure_peak_flops


def main() -> None:
    args, common = preset_run_args(__doc__, "mfu", steps=10)
    trainers = {kind: make_trainer(common + [f"model.ffn={kind}"], args.preset) for kind in ("dense", "stem")}
    peak = measure_peak_flops(seconds=0.3 if args.quick else 2.0)
    times = time_interleaved({k: t.train_step for k, t in trainers.items()}, args.steps)
    rows = {}
    print(f"{args.preset}, {args.batch_size}x{args.seq_len} tokens/step; fp32 matmul peak {peak / 1e9:.1f} GFLOP/s")
    for kind, t in trainers.items():
        tok_s = t.tokens_per_step / times[kind]
        achieved = t.flops_per_token * tok_s
        rows[kind] = {"tokens_per_s": tok_s, "train_flops_per_token": t.flops_per_token,
                      "achieved_flops": achieved, "mfu": achieved / peak}
        print(f"  {kind:>5}: {tok_s:8.0f} tok/s  {achieved / 1e9:7.1f} GFLOP/s  MFU {100 * achieved / peak:5.1f}%")
    path = write_result(args.result_name, args.quick, {"preset": args.preset, "overrides": args.overrides,
                                                       "batch_size": args.batch_size, "seq_len": args.seq_len,
                                                       "peak_flops": peak, "runs": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
