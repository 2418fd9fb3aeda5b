"""Loss curves of a run (matplotlib, Agg backend): loss vs tokens and loss vs training FLOPs."""

from __future__ import annotations

from pathlib import Path

from ..checkpoint.rundir import RunDir
from .metrics import read_metrics


def _ema(values: list[float], alpha: float = 0.1) -> list[float]:
    out, acc = [], None
    for v in values:
        acc = v if acc is None else (1 - alpha) * acc + alpha * v
        out.append(acc)
    return out


def plot_run(run_dir: str | Path, runs: dict[str, str | Path] | None = None, baseline: float | None = None,
             prefix: str = "") -> list[Path]:
    """Write ``<prefix>loss_vs_tokens.png`` and ``<prefix>loss_vs_flops.png`` into ``run_dir``.

    ``runs`` (label -> run dir) overlays several runs, e.g. dense and STEM of a comparison;
    by default only ``run_dir`` itself is drawn. ``baseline`` (e.g. the unigram entropy) is drawn
    as a dotted line. Returns the written files.
    """
    from ..runtime.plotting import pyplot, save

    plt = pyplot()

    run_dir = Path(run_dir)
    runs = runs or {run_dir.name: run_dir}
    series = {label: read_metrics(RunDir(d).metrics) for label, d in runs.items()}
    written = []
    for x_key, x_label, name in (("tokens_seen", "training tokens", "loss_vs_tokens.png"),
                                 ("flops_seen", "training FLOPs", "loss_vs_flops.png")):
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for i, (label, recs) in enumerate(series.items()):
            color = f"C{i}"
            if not recs:
                continue
            ax.plot([r[x_key] for r in recs], _ema([r["loss"] for r in recs]), color=color, alpha=0.8,
                    label=f"{label} train (EMA)")
            val = [r for r in recs if r.get("val_loss") is not None]
            if val:
                ax.plot([r[x_key] for r in val], [r["val_loss"] for r in val], "o--", color=color,
                        label=f"{label} val")
        if baseline is not None:
            ax.axhline(baseline, color="gray", linestyle=":", label=f"unigram entropy {baseline:.2f}")
        ax.set_xlabel(x_label)
        ax.set_ylabel("loss (nats/token)")
        ax.grid(alpha=0.3)
        ax.legend()
        save(fig, run_dir / f"{prefix}{name}", dpi=110)
        written.append(run_dir / f"{prefix}{name}")
    return written
