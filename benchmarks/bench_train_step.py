"""P1: training-step time of STEM (full: every layer but the first) ÷ dense on the same backbone,
next to the theoretical training-FLOP ratio from stemlm.accounting. Goal: within 3 %.

Both models run the real training loop (``Trainer.train_step``: data, forward, backward, sparse
table optimizer, clipping, AdamW) on the same synthetic Zipf data; steps are interleaved so
machine noise affects both alike, and the time ratio is the median of the per-round ratios.

    python benchmarks/bench_train_step.py            # tiny preset, 16 x 256 tokens, 40 steps
    python benchmarks/bench_train_step.py --quick    # smoke run
    python benchmarks/bench_train_step.py model.d_model=512 model.d_ff=1376   # a wider backbone
    python benchmarks/bench_train_step.py --compile  # also both models with compiled blocks

Every run also redraws ``train_step_widths.png`` from all ``train_step*.json`` results: measured
time ratio, FLOP ratio and gap against the backbone width, one point per shape measured.

To split the gap, two more pieces are timed, interleaved with the steps: STEM's own work (the
table lookups of a real batch, their backward and the sparse AdamW update of the touched rows, on
a copy of the tables) and, on random operands of the step's shape, the matmuls a dense layer does
for its up-projection and STEM skips (forward ``x W_u``, backward ``g W_u`` and ``gᵀ x``, once per
STEM layer). The time ratio can match the FLOP ratio only if the skipped matmuls run at the
step's average FLOP rate; the printout compares the two rates.

The FLOP ratio follows the paper's convention (attention scores over the full length L); the
ratio with causal attention (half the score FLOPs, what a causal kernel can skip) is printed
next to it.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from _train_bench import RESULTS, make_trainer, paired_ratio, preset_run_args, time_interleaved, write_result

from stemlm.accounting import train_flops_per_token
from stemlm.runtime.matmul import mm_nn, mm_nt, weight_grad


def up_projection_matmuls(cfg, tokens: int, n_layers: int, backend: str):
    """A function running the up-projection matmuls (forward + 2 backward) of ``n_layers`` dense layers,
    on the GEMM ``backend`` the training step uses (``stemlm.runtime.matmul``: all three as training computes them)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, cfg.d_model, generator=gen)  # (N, d)
    w = torch.randn(cfg.d_ff, cfg.d_model, generator=gen)  # (d_ff, d)
    g = torch.randn(tokens, cfg.d_ff, generator=gen)  # (N, d_ff): gradient of the up-projection's output

    def run():
        for _ in range(n_layers):
            mm_nt(x, w, backend), mm_nn(g, w, backend), weight_grad(g, x, backend)  # forward, grad of x, grad of w
    return run


def stem_own_work(trainer):
    """A function doing what only STEM does in a step: lookups of a real batch (forward and backward)
    and the sparse AdamW update of the touched rows, on a copy of ``trainer``'s tables."""
    opt = copy.deepcopy(trainer.table_opt)  # copies its tables' container and moments: the trainer's stay untouched
    ids = trainer.batch(0).inputs  # (B, T)
    grad = torch.randn(*ids.shape, trainer.model.cfg.d_ff, generator=torch.Generator().manual_seed(0))

    def run():
        layer_rows = opt.container.rows(ids)  # the ids made unique once for every layer, as the model's forward does
        rows = [layer_rows[k] for k in layer_rows]  # each (B, T, d_ff)
        torch.autograd.backward(rows, [grad] * len(rows))
        opt.step()
    return run


def backbone_width(result: dict) -> int:
    """``d_model`` of a results JSON: its preset's, or the ``model.d_model=`` override."""
    from stemlm.presets import PRESETS

    width = PRESETS[result["preset"]]["d_model"]
    for override in result["overrides"]:
        if override.startswith("model.d_model="):
            width = int(override.split("=", 1)[1])
    return width


def same_sweep(a: dict, b: dict) -> bool:
    """Whether two results differ at most in width: same preset, tokens per step and kind (smoke or
    real), and no override other than ``model.d_model`` / ``model.d_ff``."""
    widths_only = all(o.split("=", 1)[0] in ("model.d_model", "model.d_ff") for o in a["overrides"] + b["overrides"])
    keys = ("preset", "batch_size", "seq_len")
    return widths_only and a["meta"]["quick"] == b["meta"]["quick"] and all(a[k] == b[k] for k in keys)


def width_sweep(results: list[dict], latest: dict) -> list[tuple[int, dict]]:
    """``(width, result)`` of the ``results`` of the same sweep as ``latest``, by increasing width."""
    return sorted(((backbone_width(r), r) for r in results if same_sweep(r, latest)), key=lambda wr: wr[0])


def plot_widths(latest: dict) -> Path:
    """Redraw ``train_step_widths[.quick].png`` from every ``train_step*.json`` in the results dir of
    the same sweep as ``latest``: time ratio and FLOP ratio (top), gap (bottom) vs width."""
    from stemlm.runtime.plotting import pyplot, save

    plt = pyplot()

    runs = width_sweep([json.loads(f.read_text()) for f in RESULTS.glob("train_step*.json")], latest)
    widths = [w for w, _ in runs]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(6, 5.5), sharex=True)
    top.plot(widths, [r["time_ratio"] for _, r in runs], "o-", label="measured step time ratio")
    top.plot(widths, [r["flop_ratio"] for _, r in runs], "s--", label="training-FLOP ratio (theory)")
    top.set_ylabel("STEM-full ÷ dense")
    top.legend(fontsize=8)
    bottom.plot(widths, [100 * r["gap"] for _, r in runs], "o-", color="tab:red")
    for w, r in runs:
        bottom.annotate(f"{100 * r['gap']:+.1f}%", (w, 100 * r["gap"]), textcoords="offset points", xytext=(4, 4), fontsize=8)
    bottom.axhline(3, color="grey", ls="--", lw=1, label="goal: within 3 %")
    bottom.set_ylabel("gap (time ratio ÷ FLOP ratio − 1, %)")
    bottom.set_xlabel(f"d_model ({latest['preset']} preset otherwise; {latest['batch_size']}×{latest['seq_len']} tokens per step)")
    bottom.legend(fontsize=8)
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
    top.set_title("P1: STEM-full ÷ dense training step vs backbone width (2-core CPU)")
    path = RESULTS / f"train_step_widths{'.quick' if latest['meta']['quick'] else ''}.png"
    save(fig, path, dpi=110)
    return path


def main() -> None:
    args, common = preset_run_args(__doc__, "train_step", steps=40, compile_option=True)
    trainers = {kind: make_trainer(common + [f"model.ffn={kind}", "model.stem_layers=full"], args.preset)
                for kind in ("dense", "stem")}
    compiled = {f"{kind}_compiled": make_trainer(common + [f"model.ffn={kind}", "model.stem_layers=full",
                                                          "run.compile=true"], args.preset)
                for kind in ("dense", "stem")} if args.compile else {}
    tokens = args.batch_size * args.seq_len
    n_stem = len(trainers["stem"].model.cfg.stem_layer_ids)
    backend = trainers["dense"].matmul_backend
    pieces = {"up_projection": up_projection_matmuls(trainers["dense"].model.cfg, tokens, n_stem, backend),
              "stem_own": stem_own_work(trainers["stem"])}
    samples: dict[str, list[float]] = {}
    steps = {k: t.train_step for k, t in {**trainers, **compiled}.items()}
    times = time_interleaved({**steps, **pieces}, args.steps, samples=samples)
    flops = {k: train_flops_per_token(t.model.cfg, args.seq_len) for k, t in trainers.items()}
    causal = {k: train_flops_per_token(t.model.cfg, args.seq_len, causal=True) for k, t in trainers.items()}
    measured, theory = paired_ratio(samples["stem"], samples["dense"]), flops["stem"] / flops["dense"]
    ratio_of_medians = times["stem"] / times["dense"]
    theory_causal = causal["stem"] / causal["dense"]
    gap = measured / theory - 1
    rate = {"dense_step": flops["dense"] * tokens / times["dense"],
            "skipped_matmuls": (flops["dense"] - flops["stem"]) * tokens / times["up_projection"]}
    shape = " ".join([args.preset, *args.overrides])
    print(f"{shape}, {args.batch_size}x{args.seq_len} tokens/step, median of {args.steps} steps")
    for k in trainers:
        print(f"  {k:>5}: {1000 * times[k]:8.1f} ms/step   {flops[k] / 1e6:8.2f} MFLOP/token (train)")
    print(f"  STEM-full / dense time  {measured:.3f}   (median of per-round ratios; "
          f"ratio of median times {ratio_of_medians:.3f})")
    print(f"  STEM-full / dense FLOPs {theory:.3f}   gap {100 * gap:+.1f}%  (goal: within 3%: "
          f"{'met' if abs(gap) <= 0.03 else 'not met'})")
    print(f"  with causal attention FLOPs {theory_causal:.3f}   gap {100 * (measured / theory_causal - 1):+.1f}%")
    print(f"  STEM's own work (lookups, their backward, sparse AdamW): {1000 * times['stem_own']:.1f} ms "
          f"= {100 * times['stem_own'] / times['stem']:.1f}% of its step")
    gap_compiled = None
    if compiled:
        measured_compiled = paired_ratio(samples["stem_compiled"], samples["dense_compiled"])
        gap_compiled = measured_compiled / theory - 1
        print(f"  compiled blocks: dense {1000 * times['dense_compiled']:.1f}, stem {1000 * times['stem_compiled']:.1f} "
              f"ms/step; time ratio {measured_compiled:.3f}, gap {100 * gap_compiled:+.1f}%")
    print(f"  the {n_stem} up-projections STEM skips, alone: {1000 * times['up_projection']:.1f} ms at "
          f"{rate['skipped_matmuls'] / 1e9:.0f} GFLOP/s; the dense step averages {rate['dense_step'] / 1e9:.0f} GFLOP/s")
    path = write_result(args.result_name, args.quick, {
        "preset": args.preset, "overrides": args.overrides, "batch_size": args.batch_size, "seq_len": args.seq_len,
        "steps": args.steps, "stem_layers": n_stem, "seconds_per_step": times, "train_flops_per_token": flops,
        "flops_per_s": rate, "time_ratio": measured, "time_ratio_of_medians": ratio_of_medians, "flop_ratio": theory,
        "flop_ratio_causal": theory_causal, "gap": gap, "matmul": backend, "gap_compiled": gap_compiled, "gap_causal": measured / theory_causal - 1, "goal_met": abs(gap) <= 0.03})
    print(f"wrote {path}")
    print(f"wrote {plot_widths(json.loads(path.read_text()))}")


if __name__ == "__main__":
    main()
