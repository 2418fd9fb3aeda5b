"""The study's figures (matplotlib, Agg backend), drawn from the aggregated result JSON only."""

from __future__ import annotations

from pathlib import Path

from ..runtime.plotting import pyplot, save
from .tables import bucket, mean_curve


def loss_curves(groups: dict, out_dir: Path, timed: bool = False) -> list[Path]:
    """Per size: mean validation loss over seeds vs training FLOPs and vs training wall time (``timed``:
    steps × the step time measured side by side; else each run's own sum of step times)."""
    from matplotlib.ticker import NullFormatter

    plt, written = pyplot(), []
    for size, variants in groups.items():
        fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
        for i, (variant, curves) in enumerate(variants.items()):
            if not all(curves):
                continue
            for ax, key in zip(axes, ("flops", "wall")):
                xs, ys = mean_curve(curves, key)
                ax.plot(xs, ys, "o-", ms=3, color=f"C{i % 10}", label=f"{variant} (n={len(curves)})")
        wall = "steps × step time measured side by side" if timed else "sum of the run's step times"
        for ax, label in zip(axes, ("training FLOPs", f"training wall time (s, {wall})")):
            ax.set_xlabel(label)
            ax.set_ylabel("validation loss (nats/token)")
            ax.grid(alpha=0.3)
        axes[0].set_xscale("log")
        axes[0].xaxis.set_minor_formatter(NullFormatter())  # labels at decades only: minor ones overlap
        if axes[1].get_legend_handles_labels()[0]:
            axes[1].legend(fontsize=7)
        fig.suptitle(f"size {size}: same tokens for every variant")
        written.append(save(fig, out_dir / f"loss_vs_flops_and_wall_{size}.png"))
    return written


def roi_bars(rows_by_size: dict, out_dir: Path) -> Path | None:
    """Loss-based ROI (and the paper's accuracy ROI when evals exist) per variant and size."""
    plt = pyplot()
    sizes = [s for s, rows in rows_by_size.items() if any(r["loss_roi"] is not None for r in rows)]
    if not sizes:
        return None
    fig, axes = plt.subplots(1, len(sizes), figsize=(5.5 * len(sizes), 4), squeeze=False)
    for ax, size in zip(axes[0], sizes):
        rows = [r for r in rows_by_size[size] if r["loss_roi"] is not None]
        x = range(len(rows))
        ax.bar([i - 0.2 for i in x], [r["loss_roi"] for r in rows], width=0.4, label="loss ROI")
        if any(r["paper_roi"] is not None for r in rows):
            ax.bar([i + 0.2 for i in x], [r["paper_roi"] or 0 for r in rows], width=0.4, label="accuracy ROI (Table 3)")
        ax.axhline(1.0, color="gray", ls=":")
        ax.set_xticks(list(x), [r["variant"] for r in rows], rotation=40, ha="right", fontsize=8)
        ax.set_title(f"size {size}")
        ax.set_ylabel("ROI relative to dense")
        ax.legend(fontsize=7)
    return save(fig, out_dir / "roi.png")


def spikes_vs_lr(rows: list[dict], out_dir: Path) -> Path | None:
    """Robust-detector spikes and final loss against the peak learning rate; x = diverged, ▽ = collapsed."""
    if not rows:
        return None
    plt = pyplot()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    for i, variant in enumerate(sorted({r["variant"] for r in rows})):
        rs = [r for r in rows if r["variant"] == variant]
        color = f"C{i % 10}"
        a1.plot([r["lr"] for r in rs], [len(r["spikes"]) for r in rs], "o-", color=color, label=variant)
        ok = [r for r in rs if r["final_val_loss"] is not None]
        a2.plot([r["lr"] for r in ok], [r["final_val_loss"] for r in ok], "o-", color=color, label=variant)
        for r in rs:
            if r["status"] != "finished":
                a1.plot([r["lr"]], [len(r["spikes"])], "x" if r["status"] == "diverged" else "v", color=color, ms=11, mew=2)
    if rows:
        a2.axhline(rows[0]["unigram_entropy"], color="gray", ls=":", label="unigram entropy")
    for ax, label in ((a1, "loss spikes (robust detector); x diverged, ▽ collapsed"), (a2, "final validation loss")):
        ax.set_xscale("log")
        ax.set_xlabel("peak learning rate")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return save(fig, out_dir / "spikes_vs_lr.png")


def stability_curves(rows: list[dict], out_dir: Path) -> Path | None:
    """Every step's training loss of each sweep run, one panel per variant, each spike circled."""
    rows = [r for r in rows if r["train"]]
    if not rows:
        return None
    plt = pyplot()
    variants = sorted({r["variant"] for r in rows})
    cols = min(3, len(variants))
    fig, axes = plt.subplots(-(-len(variants) // cols), cols, figsize=(5 * cols, 3.6 * -(-len(variants) // cols)),
                             squeeze=False)
    for ax, variant in zip(axes.flat, variants):
        for i, r in enumerate(r for r in rows if r["variant"] == variant):
            steps, losses = [p[0] for p in r["train"]], [p[1] for p in r["train"]]
            ax.plot(steps, losses, "-", lw=0.8, color=f"C{i % 10}", label=f"lr {r['lr']:g} ({r['status']})")
            if r["spikes"]:
                ax.plot([s["step"] for s in r["spikes"]], [s["loss"] for s in r["spikes"]], "o", mfc="none",
                        color=f"C{i % 10}", ms=9, mew=1.5)
        ax.axhline(rows[0]["unigram_entropy"], color="gray", ls=":", lw=1)
        ax.set_ylim(top=min(ax.get_ylim()[1], rows[0]["unigram_entropy"] + 4))
        ax.set_title(variant, fontsize=9)
        ax.set_xlabel("step")
        ax.set_ylabel("training loss")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    for ax in list(axes.flat)[len(variants):]:
        ax.axis("off")
    fig.suptitle("every step of every sweep run; circles: spikes (robust detector); dotted: unigram entropy", fontsize=9)
    return save(fig, out_dir / "stability_curves.png")


def gap_vs_tokens(trends: dict[str, dict[str, dict]], out_dir: Path) -> Path | None:
    """Per size: each placement's validation-loss gap to dense against tokens (thin: seeds, thick: mean)
    and the trend line fitted over the second half of training, extended to where it crosses zero."""
    import math

    sizes = [s for s, t in trends.items() if t]
    if not sizes:
        return None
    plt = pyplot()
    fig, axes = plt.subplots(1, len(sizes), figsize=(6 * len(sizes), 4.2), squeeze=False)
    for ax, size in zip(axes[0], sizes):
        for i, (variant, t) in enumerate(trends[size].items()):
            color = f"C{i % 10}"
            for pairs in t["seeds"].values():
                ax.plot([p[0] for p in pairs], [p[1] for p in pairs], "-", lw=0.6, alpha=0.5, color=color)
            xs, ys = zip(*t["mean_curve"])
            ax.plot(xs, ys, "o-", ms=3, color=color, label=f"{variant} (n={len(t['seeds'])})")
            slope = t["slope"]["mean"]
            x0, y0 = t["tokens_end"], t["mean_curve"][-1][1]
            x1 = min(t["cross_tokens"] or 4 * x0, 16 * x0)
            tx = [x0 * (x1 / x0) ** (j / 20) for j in range(21)]
            ax.plot(tx, [y0 + slope * math.log2(x / x0) for x in tx], "--", color=color, lw=1)
        ax.axhline(0, color="gray", lw=1)
        ax.set_xscale("log")
        ax.set_xlabel("training tokens (dashed: trend of the second half, extrapolated)")
        ax.set_ylabel("val loss − dense (nats/token)")
        ax.set_title(f"size {size}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return save(fig, out_dir / "gap_vs_tokens.png")


def loss_by_position(rows: list[dict], out_dir: Path) -> Path | None:
    """Validation loss by position (bucketed to 32 points, mean over seeds) before and after context extension."""
    rows = [r for r in rows if r["final"]]
    if not rows:
        return None
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for i, variant in enumerate(dict.fromkeys(r["variant"] for r in rows)):
        rs = [r for r in rows if r["variant"] == variant]
        n = min(len(r["final"]) for r in rs)
        step = max(1, n // 32)
        for key, style, label in (("final", "-", "extended"), ("init", "--", "before")):
            if not all(r[key] for r in rs):
                continue
            curve = [sum(r[key][j] for r in rs) / len(rs) for j in range(n)]
            ys = bucket(curve, n // step)
            ax.plot([min(n - 1, j * step + step // 2) for j in range(len(ys))], ys, style, color=f"C{i}",
                    label=f"{variant} {label} (n={len(rs)})")
    ax.set_xlabel("position in the window (tokens of preceding text)")
    ax.set_ylabel("validation loss (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save(fig, out_dir / "loss_by_position.png")


def needle_gain_grid(rows: list[dict], out_dir: Path) -> Path | None:
    """The needle probe by depth × length, mean over seeds, one column per variant (and per positive
    control): the key − decoy margin (nats) and greedy retrieval, or the needle's gain for a probe of
    an earlier version."""
    import numpy as np

    groups: dict[str, list[dict]] = {}
    for r in rows:
        if r.get("needle"):
            groups.setdefault(r["variant"], []).append(r["needle"])
    if not groups:
        return None
    measures = [m for m in ("margin", "retrieval", "gain") if all(m in p for ps in groups.values() for p in ps)]
    measures = [m for m in measures if m != "gain"] or ["gain"]
    plt = pyplot()
    fig, axes = plt.subplots(len(measures), len(groups), figsize=(4.4 * len(groups), 3.8 * len(measures)), squeeze=False)
    for row, measure in enumerate(measures):
        grids = {v: np.mean([p[measure] for p in ps], axis=0) for v, ps in groups.items()}
        if measure == "retrieval":
            cmap, lo, hi, fmt, label = "viridis", 0.0, 1.0, "{:.0%}", "greedy retrieval of the key"
        else:
            vmax = max(float(np.abs(g).max()) for g in grids.values()) or 1.0
            cmap, lo, hi, fmt = "RdBu", -vmax, vmax, "{:+.2f}"
            label = "key − decoy log-prob (nats)" if measure == "margin" else "key log-prob gain (nats)"
        for ax, (variant, probes) in zip(axes[row], groups.items()):
            im = ax.imshow(grids[variant], cmap=cmap, vmin=lo, vmax=hi, aspect="auto")
            ax.set_xticks(range(len(probes[0]["lengths"])), probes[0]["lengths"])
            ax.set_yticks(range(len(probes[0]["depths"])), [f"{d:.0%}" for d in probes[0]["depths"]])
            for i, line in enumerate(grids[variant]):
                for j, v in enumerate(line):
                    ax.text(j, i, fmt.format(v), ha="center", va="center", fontsize=7)
            ax.set_xlabel("context length (tokens)")
            ax.set_ylabel("needle depth")
            ax.set_title(f"{variant} (n={len(probes)})", fontsize=9)
        fig.colorbar(im, ax=axes[row, -1], label=label)
    return save(fig, out_dir / "needle_gain.png")


def niah_grid(rows: list[dict], out_dir: Path) -> Path | None:
    """NIAH accuracy per model: a depth x length heat map when the eval JSON carries the ``grid`` of
    the ``needle`` task (``{"depths": [...], "lengths": [...], "acc": [[per length] per depth]}``),
    else one bar per model."""
    hits = [(r, t, s) for r in rows for t, s in r["eval"].items() if t.startswith(("needle", "niah", "passkey"))]
    if not hits:
        return None
    plt = pyplot()
    grids = [(r, t, s["grid"]) for r, t, s in hits if isinstance(s.get("grid"), dict)]
    if grids:
        fig, axes = plt.subplots(1, len(grids), figsize=(4.5 * len(grids), 4), squeeze=False)
        for ax, (r, t, g) in zip(axes[0], grids):
            im = ax.imshow(g["acc"], vmin=0, vmax=1, cmap="viridis", aspect="auto")
            ax.set_xticks(range(len(g["lengths"])), g["lengths"])
            ax.set_yticks(range(len(g["depths"])), g["depths"])
            ax.set_xlabel("context length (tokens, nominal)")
            ax.set_ylabel("needle depth")
            ax.set_title(f"{r['variant']} {t}")
        fig.colorbar(im, ax=axes[0, -1])
    else:
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.bar(range(len(hits)), [s.get("acc") or 0 for _, _, s in hits])
        ax.set_xticks(range(len(hits)), [f"{r['variant']}\n{t}" for r, t, _ in hits], fontsize=8)
        ax.set_ylabel("accuracy")
    return save(fig, out_dir / "niah.png")


def midtrain_curves(rows: list[dict], out_dir: Path) -> Path | None:
    """Training (and validation) loss of the converted models during mid-training."""
    if not rows:
        return None
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for i, r in enumerate(rows):
        if r["train"]:
            ax.plot([p[0] for p in r["train"]], [p[1] for p in r["train"]], "-", color=f"C{i}", alpha=0.6,
                    label=f"{r['variant']} train")
        val = [(0, r["val_loss_init"])] + [(v["step"], v["val_loss"]) for v in r["val"]]
        ax.plot([v[0] for v in val if v[1] is not None], [v[1] for v in val if v[1] is not None], "o--",
                color=f"C{i}", label=f"{r['variant']} val")
    ax.set_xlabel("mid-training step")
    ax.set_ylabel("loss (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save(fig, out_dir / "midtrain_loss.png")
