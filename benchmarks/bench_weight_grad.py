"""Should oneDNN compute the weight gradient too? Whole training steps with ``run.matmul=onednn``, the weight
gradient on oneDNN (``stemlm.runtime.matmul.WEIGHT_GRAD_ONEDNN``, the default) against on ATen.

Two trainers of the same shape, both ``run.matmul=onednn``, differ only in that switch, which is set before
each of their steps; their steps alternate in one process (``time_interleaved``), and each round gives one
ratio ``ATen weight gradient ÷ oneDNN weight gradient`` of step times (> 1: oneDNN is faster).

Shapes (16 × 256 tokens a step, synthetic Zipf data, fp32): P7's (the tiny preset dense, V = 8192, gradient
clipping 1.0) and P3's STEM-1/3 (the tiny preset, V = 4096).

    python benchmarks/bench_weight_grad.py              # 16 rounds a shape -> results/weight_grad.json
    python benchmarks/bench_weight_grad.py --quick      # smoke run: debug preset, 2 rounds
"""

from __future__ import annotations

import argparse
import statistics

from _train_bench import make_trainer, round_ratios, shape_overrides, time_interleaved, write_result

import stemlm.runtime.matmul as matmul

SHAPES = {
    "p7-dense": (8192, ["model.ffn=dense", "model.d_ff=688", "optim.grad_clip=1.0"]),
    "p3-stem": (4096, ["model.ffn=stem"]),
}


def step_with(trainer, on_onednn: bool):
    """``trainer.train_step`` with the weight gradient on oneDNN (True) or ATen (False)."""
    def step():
        matmul.WEIGHT_GRAD_ONEDNN = on_onednn
        return trainer.train_step()
    return step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=16, help="timed rounds per shape (default: 16)")
    ap.add_argument("--quick", action="store_true", help="debug preset, 4 x 64 tokens, 2 rounds; weight_grad.quick.json")
    args = ap.parse_args()
    batch, seq, preset = (4, 64, "debug") if args.quick else (16, 256, "tiny")
    steps = 2 if args.quick else args.steps
    default = matmul.WEIGHT_GRAD_ONEDNN
    results = {}
    try:
        for shape, (vocab, extra) in SHAPES.items():
            vocab = 512 if args.quick else vocab
            overrides = [*shape_overrides(vocab, batch, seq), f"model.vocab_size={vocab}", *extra, "run.matmul=onednn"]
            arms = {"onednn": make_trainer(overrides, preset), "aten": make_trainer(overrides, preset)}
            samples: dict[str, list[float]] = {}
            times = time_interleaved({k: step_with(t, k == "onednn") for k, t in arms.items()}, steps, samples=samples)
            ratios = round_ratios(samples["aten"], samples["onednn"])  # ATen weight gradient ÷ oneDNN, per round
            results[shape] = {"seconds_per_step": times, "step_seconds": samples, "aten_over_onednn": ratios,
                              "median": statistics.median(ratios), "min": min(ratios), "max": max(ratios),
                              "onednn_faster_every_round": all(r > 1 for r in ratios)}
            print(f"{shape:9s} weight gradient on ATen {times['aten'] * 1e3:.1f} ms, on oneDNN "
                  f"{times['onednn'] * 1e3:.1f} ms a step: ATen ÷ oneDNN {results[shape]['median']:.3f} "
                  f"[{min(ratios):.3f}, {max(ratios):.3f}] over {len(ratios)} rounds")
    finally:
        matmul.WEIGHT_GRAD_ONEDNN = default
    path = write_result("weight_grad", args.quick, {"batch_size": batch, "seq_len": seq, "steps": steps,
                                                     "shapes": results})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
