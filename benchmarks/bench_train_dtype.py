"""Training in bf16 autocast against fp32 on this machine: step time and the losses of the same steps.

Two trainers of the real training loop (``Trainer.train_step``) on the same preset, seed and synthetic Zipf
batches, one with ``run.dtype=float32`` (the default) and one with ``run.dtype=bfloat16`` (autocast: bf16
GEMMs, fp32 master weights and optimizer), take their steps interleaved, so machine noise hits both alike.
Printed and written to JSON: the median step time of each, their ratio (median of per-round ratios, with the
rounds' range), and each step's loss side by side, with the largest difference. Whether bf16 pays depends on
the CPU: with native bf16 GEMMs (AVX512-BF16 or AMX, ``stemlm.runtime.matmul.bf16_is_fast``) it can; without,
autocast only adds casts.

    python benchmarks/bench_train_dtype.py                                        # tiny, 16 x 256 tokens
    python benchmarks/bench_train_dtype.py --preset smollm2-135m --batch-size 4   # SmolLM2-135M's shape: train_dtype_smollm2-135m.json
    python benchmarks/bench_train_dtype.py --quick                                # smoke run
"""

from __future__ import annotations

import statistics

import torch
from _train_bench import make_trainer, preset_run_args, time_interleaved, write_result

from stemlm.runtime.matmul import bf16_is_fast

DTYPES = ("float32", "bfloat16")


def main() -> None:
    args, common = preset_run_args(__doc__, "train_dtype", steps=6)
    if args.preset != "tiny" and not args.quick:  # one result file a shape: train_dtype_<preset>[_<overrides>].json
        args.result_name = args.result_name.replace("train_dtype", f"train_dtype_{args.preset}", 1)
    trainers = {d: make_trainer([*common, f"run.dtype={d}", f"run.steps={args.steps + 2}"], args.preset)
                for d in DTYPES}
    losses: dict[str, list[float]] = {d: [] for d in DTYPES}

    def stepper(d):
        return lambda: losses[d].append(trainers[d].train_step()["loss"])

    samples: dict[str, list[float]] = {}
    med = time_interleaved({d: stepper(d) for d in DTYPES}, args.steps, warmup=2, samples=samples)
    rounds = [b / f for f, b in zip(samples["float32"], samples["bfloat16"])]
    ratio = statistics.median(rounds)
    diff = max(abs(a - b) for a, b in zip(losses["float32"], losses["bfloat16"]))
    cfg = trainers["float32"].model.cfg
    tokens = args.batch_size * args.seq_len
    for d in DTYPES:
        print(f"{d:>9}: {med[d]:.3f} s a step, {tokens / med[d]:,.0f} tok/s")
    print(f"bf16 ÷ fp32 step time {ratio:.3f} (rounds {min(rounds):.3f}–{max(rounds):.3f}); losses of the same steps "
          f"differ by at most {diff:.4f} (fp32 {losses['float32'][-1]:.4f}, bf16 {losses['bfloat16'][-1]:.4f} at the last)")
    path = write_result(args.result_name, args.quick, {
        "config": {"preset": args.preset, "d_model": cfg.d_model, "n_layers": cfg.n_layers, "d_ff": cfg.d_ff,
                   "vocab_size": cfg.vocab_size, "ffn": cfg.ffn, "batch_size": args.batch_size, "seq_len": args.seq_len,
                   "timed_steps": args.steps, "warmup_steps": 2, "overrides": args.overrides,
                   "bf16_is_fast": bf16_is_fast(torch.device("cpu"))},
        "seconds_per_step": med, "tokens_per_s": {d: tokens / med[d] for d in DTYPES},
        "bf16_over_fp32_step_time": ratio, "rounds": rounds, "step_seconds": samples,
        "losses": losses, "max_loss_difference": diff})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
