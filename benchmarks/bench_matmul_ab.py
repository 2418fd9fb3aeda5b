"""Which GEMMs should CPU training use by default? ``run.matmul=aten`` against ``onednn``, across processes.

``bench_vs_hf.py`` times the two inside one process; this benchmark is the A/B the default
follows (``run.matmul``: oneDNN until this A/B found ATen faster at every shape, then ATen): every
measurement is a *separate process* that builds one trainer with one setting and times its real
training loop (``Trainer.train_step``), and the two settings alternate, A B B A A B …, so the
machine's drift hits both alike. Each pair of neighbouring processes gives one ratio
``aten ÷ onednn`` of median step times (< 1: ATen is faster).

Shapes (16 × 256 tokens a step, synthetic Zipf data, fp32):

* ``p1-dense``, ``p1-stem-full``: the tiny preset, dense and STEM in every layer but the first (P1);
* ``p3-stem``: the tiny preset's STEM-1/3 (P3's STEM model);
* ``p7-dense``: P7's shape (tiny with V = 8192, gradient clipping at 1.0).

    python benchmarks/bench_matmul_ab.py                 # 3 pairs a shape, 12 steps a process
    python benchmarks/bench_matmul_ab.py --pairs 4 --shapes p7-dense
    python benchmarks/bench_matmul_ab.py --quick         # smoke run: debug preset, 2 steps

Writes ``results/matmul_ab.json``: per shape, every process's median step time and the per-pair
ratios, with their median, min and max. The verdict printed: a setting is faster at a shape only if
every pair says so.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ARMS = ("onednn", "aten")
SHAPES = {
    "p1-dense": ["model.ffn=dense"],
    "p1-stem-full": ["model.ffn=stem", "model.stem_layers=full"],
    "p3-stem": ["model.ffn=stem"],
    "p7-dense": ["model.ffn=dense", "optim.grad_clip=1.0"],
}
VOCAB = {"p7-dense": 8192}  # the others: the tiny preset's 4096


def child(shape: str, arm: str, steps: int, warmup: int, quick: bool) -> dict:
    """Time ``steps`` training steps of one trainer (this process's only one); its median step seconds."""
    from _train_bench import make_trainer, shape_overrides, time_interleaved

    batch, seq, preset, vocab = (4, 64, "debug", 512) if quick else (16, 256, "tiny", VOCAB.get(shape, 4096))
    trainer = make_trainer([*shape_overrides(vocab, batch, seq), *SHAPES[shape], f"model.vocab_size={vocab}",
                            f"run.matmul={arm}"], preset)
    samples: dict[str, list[float]] = {}
    median = time_interleaved({"step": trainer.train_step}, steps, warmup, samples)["step"]
    return {"shape": shape, "arm": arm, "median_s": median, "step_s": samples["step"]}


def order(pairs: int) -> list[tuple[int, str]]:
    """``(pair, arm)`` in run order: A B, then B A, then A B ... (each pair's two runs are neighbours)."""
    out = []
    for p in range(pairs):
        arms = ARMS if p % 2 == 0 else ARMS[::-1]
        out += [(p, a) for a in arms]
    return out


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=3, help="processes per setting and shape (default: 3)")
    ap.add_argument("--steps", type=int, default=12, help="timed steps per process (default: 12)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps per process first (default: 3)")
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    ap.add_argument("--quick", action="store_true", help="debug preset, 4 x 64 tokens, 2 steps; matmul_ab.quick.json")
    ap.add_argument("--child", nargs=2, metavar=("SHAPE", "ARM"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.quick:
        args.pairs, args.steps, args.warmup = 1, 2, 1
    if args.child:
        print(json.dumps(child(*args.child, args.steps, args.warmup, args.quick)))
        return
    shapes = args.shapes.split(",")
    bad = [s for s in shapes if s not in SHAPES]
    if bad:
        ap.error(f"unknown shapes {bad}; choose from {', '.join(SHAPES)}")
    results = {}
    for shape in shapes:
        runs = {a: [None] * args.pairs for a in ARMS}
        for p, arm in order(args.pairs):
            cmd = [sys.executable, __file__, "--child", shape, arm, "--steps", str(args.steps),
                   "--warmup", str(args.warmup), *(["--quick"] if args.quick else [])]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True)
            runs[arm][p] = json.loads(out.stdout.strip().splitlines()[-1])
            print(f"{shape:13s} pair {p} {arm:5s} {runs[arm][p]['median_s'] * 1e3:8.1f} ms/step", flush=True)
        ratios = [b["median_s"] / a["median_s"] for a, b in zip(runs["onednn"], runs["aten"])]
        results[shape] = {"overrides": SHAPES[shape], "vocab": VOCAB.get(shape, 4096), "runs": runs,
                          "aten_over_onednn": ratios, "spread": spread(ratios),
                          "aten_faster_in_every_pair": all(r < 1 for r in ratios),
                          "onednn_faster_in_every_pair": all(r > 1 for r in ratios)}
    print("\naten ÷ onednn step time, per pair of processes (< 1: ATen faster)")
    for shape, r in results.items():
        s = r["spread"]
        verdict = ("ATen faster in every pair" if r["aten_faster_in_every_pair"] else
                   "oneDNN faster in every pair" if r["onednn_faster_in_every_pair"] else "mixed")
        print(f"  {shape:13s} {s['median']:.3f} [{s['min']:.3f}, {s['max']:.3f}]  {verdict}")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _train_bench import write_result

    path = write_result("matmul_ab", args.quick, {"pairs": args.pairs, "steps": args.steps, "warmup": args.warmup,
                                                   "shapes": results})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
