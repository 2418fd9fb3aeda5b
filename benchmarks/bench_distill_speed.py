"""Local distillation's step time with each of its implementations, side by side on one real layer.

The distillation of ``convert --distill-steps N`` (``stemlm.insert.distill``) trains the rows of every id the
calibration saw as one ``(U, d_ff)`` parameter: at 262,144 calibration tokens of SmolLM2's vocabulary that is some
twenty thousand rows. Its implementations:

* ``fused Adam``: torch's Adam over every row each step as one fused pass over each parameter, fp32
  (``DistillSettings.fused_adam``; the default from 2026-11-29 until lazy rows and bf16 were measured);
* ``default Adam``: the same update with torch's default (unfused) implementation, as before;
* ``bf16``: the fused dense update with the layer's GEMMs in bfloat16 autocast (``precision="bf16"``);
* ``catch-up rows``: the dense update computed for the rows the minibatch touched only, the steps a row skipped
  applied in closed form when it is next read (``DistillSettings.rows="catchup"``): a step's cost grows with its
  tokens, not with the rows;
* ``catch-up rows + bf16``: both;
* ``lazy rows + bf16``: Adam steps on the touched rows with per-row counts (``rows="lazy"``; another update: a
  row the minibatches skip does not move), bf16 GEMMs.

This script fits one layer as ``convert`` does (``fit_layer``: gated rows, shrink 4096, the ``W_d`` refit) on the dense
model's own hidden states, then distils it from that same fit with each implementation in turn, ``--rounds`` times
interleaved (rows, ``W_d`` and ``W_g`` train, as in the recommended recipe), and reports seconds per step (the step
loop's own time, ``info["seconds_steps"]``), each one's ratio to the first implementation per round, and each run's
output error on the calibration tokens after its steps. The rest of a run (the output error over every calibration
token before and after, the copies) is its fixed cost; the projection to the recipe's ten layers × 2,000 steps adds
it once a layer. The calibration pass around the distillation (the capture, the fit, the ``W_d`` refit) is not in it.

    python benchmarks/bench_distill_speed.py                      # -> distill_speed.json (~13 min, 2 threads)
    python benchmarks/bench_distill_speed.py --steps 50 --rounds 1 --tokens 16384   # a smoke run
    python benchmarks/bench_distill_speed.py --compare "fused Adam,lazy rows + bf16"

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
from stemlm.insert.distill import DistillSettings, bf16_is_fast, distill_layer  # noqa: E402
from stemlm.runtime.files import atomic_write_text  # noqa: E402
from stemlm.version import git_commit  # noqa: E402

def _implementation(rows: str, precision: str, fused_adam: bool = True) -> dict:
    return {"rows": rows, "precision": precision, "fused_adam": fused_adam}  # every setting, whatever the defaults


IMPLEMENTATIONS = {"fused Adam": _implementation("dense", "fp32"),
                   "default Adam": _implementation("dense", "fp32", fused_adam=False),
                   "bf16": _implementation("dense", "bf16"), "catch-up rows": _implementation("catchup", "fp32"),
                   "catch-up rows + bf16": _implementation("catchup", "bf16"),
                   "lazy rows + bf16": _implementation("lazy", "bf16")}


def default_implementation(result: dict) -> str:
    """The implementation of a ``distill_speed.json`` that runs as ``DistillSettings``'s defaults ran on the
    machine that measured it (``auto`` precision: bf16 where ``bf16_is_fast`` was true)."""
    d = DistillSettings()
    precision = d.precision if d.precision != "auto" else ("bf16" if result["bf16_is_fast"] else "fp32")
    want = {"rows": d.rows, "precision": precision, "fused_adam": d.fused_adam}
    for name, settings in result["implementations"].items():
        if settings == want:
            return name
    raise KeyError(f"no implementation in the results runs as the defaults do ({want})")


def gemm_gflops(m: int, k: int, n: int, dtype: torch.dtype, repeats: int = 30) -> float:
    """Achieved GFLOP/s of ``(m, k) @ (k, n)`` products in ``dtype`` (the median of ``repeats`` timed calls)."""
    a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
    for _ in range(3):  # warm-up: oneDNN picks and caches its kernel
        a @ b
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t0)
    return 2 * m * k * n / statistics.median(times) / 1e9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layer", type=int, default=14, help="the converted layer (default: %(default)s)")
    p.add_argument("--tokens", type=int, default=262_144, help="calibration tokens (default: %(default)s, convert's)")
    p.add_argument("--steps", type=int, default=200, help="distillation steps of each run (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds of every run (default: %(default)s)")
    p.add_argument("--batch", type=int, default=1024, help="tokens per step (default: %(default)s)")
    p.add_argument("--lr", type=float, default=2e-3, help="distillation lr (default: %(default)s)")
    p.add_argument("--threads", type=int, default=2, help="torch threads (default: %(default)s)")
    p.add_argument("--compare", default=",".join(IMPLEMENTATIONS),
                   help="implementations, comma-separated; ratios are to the first (default: %(default)s)")
    p.add_argument("--out", type=Path, default=RESULTS / "distill_speed.json", help="results JSON (default: %(default)s)")
    args = p.parse_args()
    if min(args.steps, args.rounds, args.batch, args.tokens) < 1:
        raise SystemExit("--steps, --rounds, --batch and --tokens must be positive")
    names = [n.strip() for n in args.compare.split(",") if n.strip()]
    if unknown := [n for n in names if n not in IMPLEMENTATIONS]:
        raise SystemExit(f"unknown implementation(s) {unknown}; choose from {', '.join(IMPLEMENTATIONS)}")
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
    d, d_ff = dense.cfg.d_model, dense.cfg.d_ff
    gflops = {name: gemm_gflops(args.batch, d, d_ff, dtype) for name, dtype in (("fp32", torch.float32),
                                                                                ("bf16", torch.bfloat16))}
    print(f"a step's GEMM ({args.batch} × {d} × {d_ff}): fp32 {gflops['fp32']:.0f}, bf16 {gflops['bf16']:.0f} GFLOP/s",
          flush=True)

    def run(name: str) -> dict:
        settings = DistillSettings(args.steps, args.lr, args.batch, train_down=True, train_gate=True,
                                   **IMPLEMENTATIONS[name])
        t0 = time.perf_counter()
        with torch.enable_grad():
            # no target given: the run computes the dense layer's output itself, as convert's does (in its fixed cost)
            _, _, info = distill_layer(block.ffn, "stem", io["x"], io["ids"], rows, fitted, settings)
        total = time.perf_counter() - t0
        return {"step": info["seconds_steps"] / args.steps, "fixed": total - info["seconds_steps"],
                "error": info["error_after"]}

    runs: dict[str, list[dict]] = {name: [] for name in names}
    for r in range(args.rounds):
        for name in (names if r % 2 == 0 else list(reversed(names))):  # alternate who goes first
            runs[name].append(run(name))
            got = runs[name][-1]
            print(f"round {r + 1}, {name}: {got['step'] * 1e3:.1f} ms a step, fixed {got['fixed']:.1f} s, "
                  f"error {got['error']:.5f}", flush=True)
    seconds = {name: [x["step"] for x in v] for name, v in runs.items()}
    fixed = {name: [x["fixed"] for x in v] for name, v in runs.items()}
    error = {name: [x["error"] for x in v] for name, v in runs.items()}
    base = names[0]
    ratios = {name: [a / b for a, b in zip(seconds[name], seconds[base])] for name in names[1:]}
    layers, full_steps = 10, 2000  # the recommended recipe: ten converted layers, 2,000 steps each
    projected = {name: layers * (full_steps * statistics.median(seconds[name]) + statistics.median(fixed[name])) / 60
                 for name in names}
    result = {"benchmark": "distill_speed", "layer": args.layer, "calib_tokens": int(io["ids"].numel()),
              "unique_rows": unique, "d_ff": dense.cfg.d_ff, "steps": args.steps, "batch": args.batch, "lr": args.lr,
              "trains": "rows + W_d + W_g", "rounds": args.rounds,
              "implementations": {n: IMPLEMENTATIONS[n] for n in names},
              "seconds_per_step": seconds, "ratio_to": base, "step_ratio": ratios,
              "step_ratio_median": {n: statistics.median(v) for n, v in ratios.items()},
              "fixed_seconds_per_run": fixed, "projected_minutes_10_layers_2000_steps": projected,
              "error_after": error, "bf16_is_fast": bf16_is_fast(torch.device("cpu")), "gemm_gflops": gflops,
              "threads": args.threads,
              "git_commit": git_commit()}
    for name, v in ratios.items():
        print(f"{name} ÷ {base}, seconds a step: {statistics.median(v):.3f} (rounds {min(v):.3f} – {max(v):.3f})")
    print(f"{unique:,} rows × {dense.cfg.d_ff} train; projected distillation of ten layers × 2,000 steps: " +
          ", ".join(f"{name} {m:.1f} min" for name, m in projected.items()))
    atomic_write_text(args.out, json.dumps(result, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
