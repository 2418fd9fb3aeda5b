"""Which GEMMs should CPU training use? ``run.matmul=aten`` against ``onednn``, across processes, and
whether ``run.matmul=auto`` (the default: a probe of both at the run's shapes) picks the winner.

``bench_vs_hf.py`` times the two inside one process; this benchmark is the A/B that checks the
default's probe (``stemlm/runtime/matmul_probe.py``; the winner differs between CPUs): every
measurement is a *separate process* that builds one trainer with one setting and times its real
training loop (``Trainer.train_step``), and the two settings alternate, A B B A A B …, so the
machine's drift hits both alike. Each pair of neighbouring processes gives one ratio
``aten ÷ onednn`` of median step times (< 1: ATen is faster). Then one more process per shape builds
the trainer with ``run.matmul=auto`` and an empty cache, so its probe measures afresh; the verdict says
whether its pick is the backend every pair found faster.

Shapes (16 × 256 tokens a step, synthetic Zipf data, fp32):

* ``p1-dense``, ``p1-stem-full``: the tiny preset, dense and STEM in every layer but the first (P1);
* ``p3-stem``: the tiny preset's STEM-1/3 (P3's STEM model);
* ``p7-dense``: P7's shape (tiny with V = 8192, gradient clipping at 1.0).

    python benchmarks/bench_matmul_ab.py                 # 3 pairs a shape, 12 steps a process
    python benchmarks/bench_matmul_ab.py --pairs 4 --shapes p7-dense
    python benchmarks/bench_matmul_ab.py --quick         # smoke run: debug preset, 2 steps

Writes ``results/matmul_ab.json``: per shape, every process's median step time and the per-pair
ratios, with their median, min and max, and ``auto``'s pick with its probe's figures. The verdict
printed: a setting is faster at a shape only if every pair says so.
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
    """Time ``steps`` training steps of one trainer (this process's only one); its median step seconds.
    ``arm`` ``auto``: build the trainer with an empty probe cache and report what the probe picked."""
    import os
    import tempfile

    from _train_bench import make_trainer, shape_overrides, time_interleaved

    batch, seq, preset, vocab = (4, 64, "debug", 512) if quick else (16, 256, "tiny", VOCAB.get(shape, 4096))
    overrides = [*shape_overrides(vocab, batch, seq), *SHAPES[shape], f"model.vocab_size={vocab}", f"run.matmul={arm}"]
    if arm == "auto":
        from stemlm.runtime.matmul_probe import choose_matmul

        with tempfile.TemporaryDirectory() as cache:
            os.environ["STEMLM_CACHE"] = cache  # empty: the trainer's probe measures afresh
            trainer = make_trainer(overrides, preset)
            choice = choose_matmul(trainer.model, batch * seq)  # what the trainer's own probe cached just now
        return {"shape": shape, "arm": arm, "picked": trainer.matmul_backend, "aten_s": choice.aten_s,
                "onednn_s": choice.onednn_s, "probe_rows": choice.rows}
    trainer = make_trainer(overrides, preset)
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


def run_child(shape: str, arm: str, args) -> dict:
    """``child(shape, arm)`` in a process of its own; what it printed."""
    cmd = [sys.executable, __file__, "--child", shape, arm, "--steps", str(args.steps),
           "--warmup", str(args.warmup), *(["--quick"] if args.quick else [])]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=3, help="processes per setting and shape (default: 3)")
    ap.add_argument("--steps", type=int, default=12, help="timed steps per process (default: 12)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps per process first (default: 3)")
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    ap.add_argument("--quick", action="store_true", help="debug preset, 4 x 64 tokens, 2 steps; matmul_ab.quick.json")
    ap.add_argument("--child", nargs=2, metavar=("SHAPE", "ARM"), help=argparse.SUPPRESS)  # ARM: aten|onednn|auto
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
            runs[arm][p] = run_child(shape, arm, args)
            print(f"{shape:13s} pair {p} {arm:5s} {runs[arm][p]['median_s'] * 1e3:8.1f} ms/step", flush=True)
        ratios = [b["median_s"] / a["median_s"] for a, b in zip(runs["onednn"], runs["aten"])]
        auto = run_child(shape, "auto", args)
        winner = "aten" if all(r < 1 for r in ratios) else "onednn" if all(r > 1 for r in ratios) else None
        print(f"{shape:13s} auto picks {auto['picked']} (probe: ATen {auto['aten_s'] * 1e3:.1f} ms, oneDNN "
              f"{auto['onednn_s'] * 1e3:.1f} ms of GEMMs)", flush=True)
        results[shape] = {"overrides": SHAPES[shape], "vocab": VOCAB.get(shape, 4096), "runs": runs,
                          "aten_over_onednn": ratios, "spread": spread(ratios),
                          "aten_faster_in_every_pair": winner == "aten", "onednn_faster_in_every_pair": winner == "onednn",
                          "auto": auto, "auto_picks_the_winner": None if winner is None else auto["picked"] == winner}
    print("\naten ÷ onednn step time, per pair of processes (< 1: ATen faster)")
    for shape, r in results.items():
        s = r["spread"]
        verdict = ("ATen faster in every pair" if r["aten_faster_in_every_pair"] else
                   "oneDNN faster in every pair" if r["onednn_faster_in_every_pair"] else "mixed")
        agrees = {True: "auto picks it", False: "auto picks the other", None: "auto picks " + r["auto"]["picked"]}
        print(f"  {shape:13s} {s['median']:.3f} [{s['min']:.3f}, {s['max']:.3f}]  {verdict}; "
              f"{agrees[r['auto_picks_the_winner']]}")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _train_bench import write_result

    path = write_result("matmul_ab", args.quick, {"pairs": args.pairs, "steps": args.steps, "warmup": args.warmup,
                                                   "shapes": results})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
