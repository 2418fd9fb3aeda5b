"""How should oneDNN compute the weight gradient? Whole training steps with ``run.matmul=onednn``, one trainer per
way of computing it (``stemlm.runtime.matmul.WEIGHT_GRAD``, see ``weight_grad``):

* ``onednn`` (the default since 2026-11-29): oneDNN, handed the narrower operand first (the one it copies into
  contiguous rows), the product taken as ``(x.T @ grad).T`` when the layer's output is wider than its input;
* ``onednn-grad-first``: oneDNN with the gradient first whatever the shape (the default 2026-11-28 to 2026-11-29);
* ``aten``: ATen's ``grad.T @ x`` (before 2026-11-28).

The trainers are of the same shape and differ only in that switch, which is set before each of their steps; their
steps alternate in one process (``time_interleaved``), and each round gives one ratio per other arm, ``arm ÷
onednn`` of step times (> 1: the default is faster).

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


def step_with(trainer, mode: str):
    """``trainer.train_step`` with the weight gradient computed the ``mode`` way (``matmul.WEIGHT_GRADS``)."""
    def step():
        matmul.WEIGHT_GRAD = mode
        return trainer.train_step()
    return step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=16, help="timed rounds per shape (default: 16)")
    ap.add_argument("--quick", action="store_true", help="debug preset, 4 x 64 tokens, 2 rounds; weight_grad.quick.json")
    args = ap.parse_args()
    batch, seq, preset = (4, 64, "debug") if args.quick else (16, 256, "tiny")
    steps = 2 if args.quick else args.steps
    default = matmul.WEIGHT_GRAD
    results = {}
    try:
        for shape, (vocab, extra) in SHAPES.items():
            vocab = 512 if args.quick else vocab
            overrides = [*shape_overrides(vocab, batch, seq), f"model.vocab_size={vocab}", *extra, "run.matmul=onednn"]
            arms = {mode: make_trainer(overrides, preset) for mode in matmul.WEIGHT_GRADS}
            samples: dict[str, list[float]] = {}
            times = time_interleaved({k: step_with(t, k) for k, t in arms.items()}, steps, samples=samples)
            row = {"seconds_per_step": times, "step_seconds": samples}
            for other in (m for m in matmul.WEIGHT_GRADS if m != "onednn"):
                ratios = round_ratios(samples[other], samples["onednn"])  # the other arm's step ÷ the default's
                row[f"{other}_over_onednn"] = {"rounds": ratios, "median": statistics.median(ratios), "min": min(ratios),
                                               "max": max(ratios), "default_faster_every_round": all(r > 1 for r in ratios)}
                print(f"{shape:9s} {other:>17s} {times[other] * 1e3:6.1f} ms a step, onednn {times['onednn'] * 1e3:6.1f} "
                      f"ms: ÷ {row[f'{other}_over_onednn']['median']:.3f} [{min(ratios):.3f}, {max(ratios):.3f}] over "
                      f"{len(ratios)} rounds")
            results[shape] = row
    finally:
        matmul.WEIGHT_GRAD = default
    path = write_result("weight_grad", args.quick, {"batch_size": batch, "seq_len": seq, "steps": steps,
                                                     "arms": list(matmul.WEIGHT_GRADS), "shapes": results})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
