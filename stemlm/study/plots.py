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
    """Loss spikes and final loss against the peak learning rate; diverged runs marked with x."""
    if not rows:
        return None
    plt = pyplot()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    for i, variant in enumerate(sorted({r["variant"] for r in rows})):
        rs = [r for r in rows if r["variant"] == variant]
        color = f"C{i % 10}"
        a1.plot([r["lr"] for r in rs], [r["spikes"] for r in rs], "o-", color=color, label=variant)
        ok = [r for r in rs if r["status"] == "finished"]
        a2.plot([r["lr"] for r in ok], [r["final_val_loss"] for r in ok], "o-", color=color, label=variant)
        for r in rs:
            if r["status"] == "diverged":
                a1.plot([r["lr"]], [r["spikes"]], "x", color=color, ms=12, mew=2)
    for ax, label in ((a1, "loss spikes (trainer's detector); x = diverged"), (a2, "final validation loss")):
        ax.set_xscale("log")
        ax.set_xlabel("peak learning rate")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return save(fig, out_dir / "spikes_vs_lr.png")


def loss_by_position(rows: list[dict], out_dir: Path) -> Path | None:
    """Validation loss by position (bucketed to 32 points) before and after context extension."""
    rows = [r for r in rows if r["final"]]
    if not rows:
        return None
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for i, r in enumerate(rows):
        n = len(r["final"])
        step = max(1, n // 32)
        xs = [min(n - 1, j * step + step // 2) for j in range(len(bucket(r["final"], n // step)))]
        ax.plot(xs, bucket(r["final"], n // step), "-", color=f"C{i}", label=f"{r['variant']} extended")
        if r["init"]:
            ax.plot(xs, bucket(r["init"], n // step), "--", color=f"C{i}", label=f"{r['variant']} before")
    ax.set_xlabel("position in the window (tokens of preceding text)")
    ax.set_ylabel("validation loss (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save(fig, out_dir / "loss_by_position.png")


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
