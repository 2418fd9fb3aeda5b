"""Local distillation's step time with torch's fused Adam against its default Adam, side by side on one real layer.

The distillation of ``convert --distill-steps N`` (``stemlm.insert.distill``) trains the rows of every id the
calibration saw as one ``(U, d_ff)`` parameter: at 262,144 calibration tokens of SmolLM2's vocabulary that is some
twenty thousand rows, and Adam's passes over them and their moments cost more than the layer's GEMMs on two cores.
``DistillSettings.fused_adam`` (the default since 2026-11-29) runs each parameter's update as one fused pass. This
script fits one layer as ``convert`` does (``fit_layer``: gated rows, shrink 4096, the ``W_d`` refit) on the dense
model's own hidden states, then distils it from that same fit with each implementation in turn, ``--rounds`` times
interleaved (rows, ``W_d`` and ``W_g`` train, as in the recommended recipe), and reports seconds per step, their
ratio per round, and each run's output error on the calibration tokens (the two should agree to rounding). A
run's fixed cost (the error before and after over every calibration token, the copies) is timed by a 0-step run in
each round and taken off; the projection to the recipe's ten layers × 2,000 steps adds it back once a layer.

    python benchmarks/bench_distill_speed.py                      # -> distill_speed.json (~12 min, 2 threads)
    python benchmarks/bench_distill_speed.py --steps 50 --rounds 1 --tokens 16384   # a smoke run

Time it on a quiet machine: nothing else may run beside it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_distill_layer import fit_as_convert, layer_io  # noqa: E402
from bench_insertion import RESULTS, dense_and_data  # noqa: E402

from stemlm.insert.calibrate import CalibrationConfig, calibration_windows  # noqa: E402
from stemlm.insert.distill import DistillSettings, distill_layer  # noqa: E402
from stemlm.runtime.files import atomic_write_text  # noqa: E402
from stemlm.version import git_commit  # noqa: E402

IMPLEMENTATIONS = {"default Adam": False, "fused Adam": True}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layer", type=int, default=14, help="the converted layer (default: %(default)s)")
    p.add_argument("--tokens", type=int, default=262_144, help="calibration tokens (default: %(default)s, convert's)")
    p.add_argument("--steps", type=int, default=200, help="distillation steps of each run (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds of both runs (default: %(default)s)")
    p.add_argument("--batch", type=int, default=1024, help="tokens per step (default: %(default)s)")
    p.add_argument("--lr", type=float, default=2e-3, help="distillation lr (default: %(default)s)")
    p.add_argument("--threads", type=int, default=2, help="torch threads (default: %(default)s)")
    p.add_argument("--out", type=Path, default=RESULTS / "distill_speed.json", help="results JSON (default: %(default)s)")
    args = p.parse_args()
    if min(args.steps, args.rounds, args.batch, args.tokens) < 1:
        raise SystemExit("--steps, --rounds, --batch and --tokens must be positive")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    dense, train, _ = dense_and_data()
    if not 0 <= args.layer < dense.cfg.n_layers:
        raise SystemExit(f"--layer {args.layer} is outside the model's {dense.cfg.n_layers} layers")
    calib = CalibrationConfig(tokens=args.tokens, shrink=4096.0)
    windows = calibration_windows(train.tokens, calib.tokens, calib.seq_len)  # (n, 256)
    t0 = time.perf_counter()
    io = layer_io(dense, args.layer, windows)
    block = dense.layers[args.layer]
    rows, fitted = fit_as_convert(dense, args.layer, io["stream"], windows, calib)
    print(f"captured and fitted layer {args.layer} in {time.perf_counter() - t0:.0f} s", flush=True)
    unique = int(torch.unique(io["ids"]).numel())

    def run(steps: int, fused: bool) -> tuple[float, float]:
        settings = DistillSettings(steps, args.lr, args.batch, train_down=True, train_gate=True, fused_adam=fused)
        t0 = time.perf_counter()
        with torch.enable_grad():
            _, _, info = distill_layer(block.ffn, "stem", io["x"], io["ids"], rows, fitted, settings, target=io["y"])
        return time.perf_counter() - t0, info["error_after"]

    seconds: dict[str, list[float]] = {name: [] for name in IMPLEMENTATIONS}
    error: dict[str, list[float]] = {name: [] for name in IMPLEMENTATIONS}
    fixed: list[float] = []
    for r in range(args.rounds):
        fixed.append(run(0, True)[0])  # what a run costs besides its steps: the error before and after, the copies
        order = list(IMPLEMENTATIONS) if r % 2 == 0 else list(reversed(IMPLEMENTATIONS))  # alternate who goes first
        for name in order:
            total, err = run(args.steps, IMPLEMENTATIONS[name])
            seconds[name].append((total - fixed[-1]) / args.steps)
            error[name].append(err)
            print(f"round {r + 1}, {name}: {seconds[name][-1] * 1e3:.1f} ms a step (the run's fixed "
                  f"{fixed[-1]:.1f} s taken off), error {err:.5f}", flush=True)
    ratios = [f / d for f, d in zip(seconds["fused Adam"], seconds["default Adam"])]
    if min(min(v) for v in seconds.values()) <= 0:
        print(f"warning: at --steps {args.steps} the runs' fixed cost (~{statistics.median(fixed):.0f} s) swamps their "
              "steps and a step time came out <= 0: the figures below are noise; give more --steps", flush=True)
    layers, full_steps = 10, 2000  # the recommended recipe: ten converted layers, 2,000 steps each
    projected = {name: layers * (full_steps * statistics.median(v) + statistics.median(fixed)) / 60
                 for name, v in seconds.items()}
    result = {"benchmark": "distill_speed", "layer": args.layer, "calib_tokens": int(io["ids"].numel()),
              "unique_rows": unique, "d_ff": dense.cfg.d_ff, "steps": args.steps, "batch": args.batch, "lr": args.lr,
              "trains": "rows + W_d + W_g", "rounds": args.rounds, "seconds_per_step": seconds,
              "fused_over_default": ratios, "fused_over_default_median": statistics.median(ratios),
              "fixed_seconds_per_run": fixed, "projected_minutes_10_layers_2000_steps": projected,
              "error_after": error, "threads": args.threads, "git_commit": git_commit()}
    print(f"fused ÷ default Adam, seconds a step: {statistics.median(ratios):.3f} (rounds {min(ratios):.3f} – "
          f"{max(ratios):.3f}); {unique:,} rows × {dense.cfg.d_ff} train")
    print("projected distillation of ten layers × 2,000 steps: " +
          ", ".join(f"{name} {m:.0f} min" for name, m in projected.items()))
    atomic_write_text(args.out, json.dumps(result, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
