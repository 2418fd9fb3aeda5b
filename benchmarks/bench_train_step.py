"""P1: training-step time of STEM (full: every layer but the first) ÷ dense on the same backbone,
next to the theoretical training-FLOP ratio from stemlm.accounting. Goal: within 3 %.

Both models run the real training loop (``Trainer.train_step``: data, forward, backward, sparse
table optimizer, clipping, AdamW) on the same synthetic Zipf data; steps are interleaved so
machine noise affects both alike.

    python benchmarks/bench_train_step.py            # tiny preset, 16 x 256 tokens, 20 steps
    python benchmarks/bench_train_step.py --quick    # smoke run
"""

from __future__ import annotations

from _train_bench import make_trainer, preset_run_args, time_interleaved, write_result

from stemlm.accounting import train_flops_per_token


def main() -> None:
    args, common = preset_run_args(__doc__, "train_step", steps=20)
    trainers = {kind: make_trainer(common + [f"model.ffn={kind}", "model.stem_layers=full"], args.preset)
                for kind in ("dense", "stem")}
    times = time_interleaved({k: t.train_step for k, t in trainers.items()}, args.steps)
    flops = {k: train_flops_per_token(t.model.cfg, args.seq_len) for k, t in trainers.items()}
    measured, theory = times["stem"] / times["dense"], flops["stem"] / flops["dense"]
    gap = measured / theory - 1
    print(f"{args.preset}, {args.batch_size}x{args.seq_len} tokens/step, median of {args.steps} steps")
    for k in trainers:
        print(f"  {k:>5}: {1000 * times[k]:8.1f} ms/step   {flops[k] / 1e6:8.2f} MFLOP/token (train)")
    print(f"  STEM-full / dense time  {measured:.3f}")
    print(f"  STEM-full / dense FLOPs {theory:.3f}   gap {100 * gap:+.1f}%  (goal: within 3%: "
          f"{'met' if abs(gap) <= 0.03 else 'not met'})")
    path = write_result("train_step", args.quick, {
        "preset": args.preset, "batch_size": args.batch_size, "seq_len": args.seq_len, "steps": args.steps,
        "seconds_per_step": times, "train_flops_per_token": flops, "time_ratio": measured, "flop_ratio": theory,
        "gap": gap, "goal_met": abs(gap) <= 0.03})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
