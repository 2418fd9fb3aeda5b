"""The GPU mid-training part of docs/insertion.md: ``benchmarks/results/gpu_midtrain/*.json``.

Each file is one ``benchmarks/gpu_midtrain.py`` invocation as the device wrote it. Files with the same
step count are one experiment (their seeds are pooled); each STEM arm is compared with dense on the
same seed (the same batches), and the spread is over seeds.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import numpy as np

from _edit_report import pyplot_or_none
from gpu_midtrain import gaps
from stemlm.runtime.plotting import save
from stemlm.study.stats import one_sample

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "gpu_midtrain"
PLOT = ROOT / "results" / "insertion" / "gpu_midtrain.png"
ANNEAL_GOAL = 0.5
CLAIM_TOKENS = 50_000_000  # the GPU goal is stated at >= 50M tokens per arm


def experiments(files: dict[str, dict] | None = None) -> dict[int, dict]:
    """``{steps: {"seeds": {seed: {arm: result}}, "files": [...], "device", "settings"}}`` from the result
    files (``{name: JSON}``; default: those in ``RESULTS``)."""
    if files is None:
        files = {p.name: json.loads(p.read_text()) for p in sorted(RESULTS.glob("*.json")) if ".smoke." not in p.name}
    out: dict[int, dict] = {}
    for name, d in files.items():
        steps = d["settings"]["steps"]
        e = out.setdefault(steps, {"seeds": {}, "files": [], "device": d["device"], "torch": d["torch"],
                                   "settings": d["settings"]})
        e["seeds"].update(d["seeds"])
        e["files"].append(Path(name).name)
    return out


def main_experiment(exps: dict[int, dict]) -> int:
    """The step count with the most seeds: the experiment the goals are read from."""
    return max(exps, key=lambda k: len(exps[k]["seeds"]))


def gap_text(e: dict, arm: str) -> str:
    """``arm`` − dense at the end, paired by seed: mean, 95 % t interval and smallest detectable difference."""
    return one_sample(gaps(e["seeds"], arm)).text(" nats")


def tokens_per_arm(e: dict) -> int:
    st = e["settings"]
    return st["steps"] * st["batch_size"] * st["seq_len"]


def claim_met(e: dict, arm: str) -> bool:
    """The issue's GPU goal: ``arm`` below dense continued on every seed, after >= CLAIM_TOKENS tokens."""
    return tokens_per_arm(e) >= CLAIM_TOKENS and max(gaps(e["seeds"], arm)) < 0


def readme_cell(files: dict[str, dict]) -> tuple[str, bool]:
    """The README results row: ``(measured, goal met)`` from the result files (``{name: JSON}``)."""
    exps = experiments(files)
    e = exps[main_experiment(exps)]
    arms = [a for a in next(iter(e["seeds"].values())) if a != "dense"]
    cells = "; ".join(f"{a} {gap_text(e, a)} (step 0 {statistics.fmean(gaps(e['seeds'], a, 'init_loss')):+.2f})"
                      for a in arms)
    return (f"{e['device']}, {tokens_per_arm(e):,} tokens per arm (one epoch of the offline corpus; "
            f"{CLAIM_TOKENS // 1_000_000}M tokens need more text than it holds): {cells} "
            "([docs](docs/insertion.md#mid-training-on-one-gpu))"), all(claim_met(e, a) for a in arms)


def _curve_gap(e: dict, arm: str) -> tuple[np.ndarray, np.ndarray]:
    """Tokens and the mean over seeds of the arm's validation loss minus dense's at each evaluation."""
    seeds = [s for s in e["seeds"].values() if arm in s]
    tokens = np.array([c[1] for c in seeds[0]["dense"]["curve"]])
    gap = np.mean([[a[2] - d[2] for a, d in zip(s[arm]["curve"], s["dense"]["curve"])] for s in seeds], axis=0)
    return tokens, gap


def gpu_midtrain_section() -> list[str]:
    """Markdown for the GPU runs, or nothing if there are none."""
    exps = experiments()
    if not exps:
        return []
    main_steps = main_experiment(exps)
    e = exps[main_steps]
    st = e["settings"]
    per_step = st["batch_size"] * st["seq_len"]
    first = next(iter(e["seeds"].values()))
    lines = ["", "### Mid-training on one GPU", "",
             f"{e['device']}, torch {e['torch']}: `python benchmarks/gpu_midtrain.py --corpus DIR` (`studies/midtrain-gpu.yaml`'s arms, lr {st['lr']}, "
             f"{st['steps']} steps × {per_step:,} tokens = {tokens_per_arm(e):,} tokens per arm: one epoch of the "
             f"offline corpus in SmolLM2's tokenizer; calibration {st['calibration']['tokens']:,} tokens on the GPU, "
             "W_d refit). The arms step in lockstep on the same batches; validation loss on "
             "the held-out split. Files: " + ", ".join(f"`{f}`" for f in e["files"]) + ".", "",
             "| arm | step 0 | end (mean over seeds) | − dense at step 0 | − dense at the end | tokens/s | step time ÷ dense |",
             "|---|---|---|---|---|---|---|"]
    for arm in first:
        finals = [s[arm]["final_loss"] for s in e["seeds"].values() if arm in s]
        tps = statistics.fmean(s[arm]["tokens_per_s"] for s in e["seeds"].values() if arm in s)
        ratio = statistics.fmean(s[arm]["median_step_s"] / s["dense"]["median_step_s"] for s in e["seeds"].values() if arm in s)
        if arm == "dense":
            lines.append(f"| dense continued | {first[arm]['init_loss']:.3f} | {statistics.fmean(finals):.3f} | — | — | "
                         f"{tps:,.0f} | 1 |")
            continue
        lines.append(f"| {arm} | {first[arm]['init_loss']:.3f} | {statistics.fmean(finals):.3f} | "
                     f"{statistics.fmean(gaps(e['seeds'], arm, 'init_loss')):+.3f} | {gap_text(e, arm)} | {tps:,.0f} | "
                     f"×{ratio:.2f} |")
    lines += ["", "Goals:"]
    for arm in first:
        if arm == "dense":
            continue
        lines.append(f"* {arm} below dense continued after ≥ {CLAIM_TOKENS:,} tokens (the paper's claim, Table 4): "
                     f"{'met' if claim_met(e, arm) else 'not met'} — {gap_text(e, arm)} after {tokens_per_arm(e):,} tokens")
        if "gradual" in arm:
            tokens, curve = _curve_gap(e, arm)
            peak = int(np.argmax(curve))
            lines.append(f"* {arm} never above dense + {ANNEAL_GOAL} nats on the way: "
                         f"{'met' if curve.max() <= ANNEAL_GOAL else 'not met'} — peak {curve[peak]:+.3f} at "
                         f"{tokens[peak]:,} tokens (validation, mean over seeds)")
    for steps, longer in sorted(exps.items()):
        if steps == main_steps:
            continue
        tokens, curve = _curve_gap(longer, "stem-calibrated") if "stem-calibrated" in next(iter(longer["seeds"].values())) else (None, None)
        if curve is None:
            continue
        epoch = main_steps * per_step
        marks = [f"{curve[i]:+.3f} after {tokens[i] / epoch:.0f} epoch{'s' if tokens[i] > epoch else ''}"
                 for i in range(len(tokens)) if tokens[i] and tokens[i] % epoch == 0]
        dense = [c[2] for c in next(iter(longer["seeds"].values()))["dense"]["curve"]]
        lines += ["", f"The trend, on the same text repeated ({steps} steps = {steps * per_step:,} tokens, "
                  f"{len(longer['seeds'])} seed, its own schedule): stem-calibrated − dense {', '.join(marks)}. "
                  f"Dense's validation loss is lowest at {min(dense):.3f} and ends at {dense[-1]:.3f}: from the second "
                  "epoch on both arms memorise, so the gap's plateau there is not a forecast for fresh text."]
    plot = plot_gpu(exps, main_steps)
    if plot is not None:
        lines += ["", f"![GPU mid-training]({Path('..') / plot.relative_to(ROOT)})"]
    return lines


def plot_gpu(exps: dict, main_steps: int) -> Path | None:
    """Validation loss of each arm (one epoch, mean over seeds) and each STEM arm's gap to dense."""
    plt = pyplot_or_none()
    if plt is None:
        return None
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for steps, e in sorted(exps.items()):
        tag = "" if steps == main_steps else f" ({steps} steps, repeated text)"
        seeds = list(e["seeds"].values())
        for arm in seeds[0]:
            tokens = [c[1] for c in seeds[0][arm]["curve"]]
            mean = np.mean([[c[2] for c in s[arm]["curve"]] for s in seeds if arm in s], axis=0)
            a.plot(tokens, mean, marker="o" if not tag else None, ls="-" if not tag else ":", label=arm + tag)
            if arm != "dense":
                t, gap = _curve_gap(e, arm)
                b.plot(t, gap, marker="o" if not tag else None, ls="-" if not tag else ":", label=arm + tag)
    b.axhline(0, color="k", lw=0.8)
    b.axhline(ANNEAL_GOAL, color="grey", ls="--", lw=0.8, label=f"gradual-insertion bound (+{ANNEAL_GOAL})")
    a.set(xlabel="tokens", ylabel="validation loss (nats)", title="SmolLM2-135M mid-training on one GPU")
    b.set(xlabel="tokens", ylabel="validation loss − dense (nats)", title="gap to dense continued")
    a.legend(fontsize=7)
    b.legend(fontsize=7)
    return save(fig, PLOT, dpi=110)
