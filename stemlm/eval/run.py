"""Evaluate models on tasks: results documents, the stdout table, and the comparison chart.

One document per model: ``{"model": {"hash", "path", "max_length"}, "stemlm": VERSION+COMMIT, "settings": {...},
"tasks": {TASK: {"metric", "n", "shots", "chance", <metric>, <metric>_stderr, ...}}}``. The file
of ``stemlm eval --output`` is that document for one model and ``{"models": [doc, ...]}`` for
several (``documents_of`` reads both).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from .. import __version__
from ..runtime.files import atomic_write_text
from ..version import git_commit
from .api import LanguageModel
from .cache import CachedLM
from .metrics import paired_difference
from .tasks import Task

Z = 2.0  # a result is "above chance" when value - Z * stderr > chance


def stemlm_version() -> str:
    """``VERSION+gCOMMIT`` of this source tree (``-dirty`` with uncommitted changes), or just the version."""
    commit = git_commit()
    return f"{__version__}+g{commit}" if commit else __version__


def evaluate_model(lm: LanguageModel, tasks: list[Task], shots: int = 0, limit: int | None = None, seed: int = 0,
                   cache_dir: Path | None = None, batch_size: int = 64, progress: bool = True) -> dict[str, dict]:
    """``{task name: result}`` of ``lm`` on ``tasks``, every request answered through the result cache."""
    cached = CachedLM(lm, cache_dir, batch_size=batch_size, progress=progress)
    try:
        results = {}
        for task in tasks:
            cached.desc = task.name
            results[task.name] = {**task.evaluate(cached, shots, limit, seed), "source": task.source}
        return results
    finally:
        cached.close()


def results_document(path: str, identity: str, results: dict[str, dict], settings: dict,
                     max_length: int | None = None) -> dict:
    """The results contract of one model (see the module docstring); ``max_length`` joins the model block."""
    model = {"hash": identity, "path": str(path), **({"max_length": max_length} if max_length else {})}
    return {"model": model, "stemlm": stemlm_version(), "settings": settings, "tasks": results}


def write_results(path: Path, docs: list[dict]) -> None:
    """Write one document, or ``{"models": docs, "paired": paired(docs)}`` for several, atomically (NaN as null)."""
    data = _nan_to_none(docs[0] if len(docs) == 1 else {"models": docs, "paired": paired(docs)})
    atomic_write_text(path, json.dumps(data, indent=2, allow_nan=False) + "\n")


def _nan_to_none(x):
    """Strict JSON: NaN (an undefined error, e.g. of one item) becomes null."""
    if isinstance(x, dict):
        return {k: _nan_to_none(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_nan_to_none(v) for v in x]
    return None if isinstance(x, float) and math.isnan(x) else x


def documents_of(data: dict) -> list[dict]:
    """The per-model documents of a results file (either layout)."""
    return data["models"] if "models" in data else [data]


def above_chance(result: dict) -> bool | None:
    """Whether the primary metric beats chance (``chance_<metric>`` or ``chance``) by ``Z`` standard
    errors (None: no chance level or no error)."""
    chance, value = result.get(f"chance_{result['metric']}", result.get("chance")), result[result["metric"]]
    err = result.get(f"{result['metric']}_stderr")
    if chance is None or err is None or value is None or math.isnan(err) or math.isnan(value):
        return None
    return value - Z * err > chance


def _fmt(x: float | None) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.4f}"


def _name(doc: dict) -> str:
    return Path(doc["model"]["path"]).name or doc["model"]["path"]


def paired(docs: list[dict], z: float = 1.96) -> list[dict]:
    """Every later model against the first on each task both scored item by item on the same items
    (``metrics.paired_difference`` of the primary metric): ``[{"task", "model", "reference", "metric", "diff",
    "stderr", "low", "high", "n", ...}]``; tasks without per-item outcomes, or on other items, are left out."""
    if len(docs) < 2:
        return []
    ref, out = docs[0], []
    for doc in docs[1:]:
        for task, r in doc["tasks"].items():
            base = ref["tasks"].get(task)
            if base is None or "items" not in r or "items" not in base or r["metric"] != base["metric"]:
                continue
            m = r["metric"]
            if r["items"]["ids"] != base["items"]["ids"] or m not in r["items"] or m not in base["items"]:
                continue
            out.append({"task": task, "model": _name(doc), "reference": _name(ref), "metric": m,
                        **paired_difference(r["items"][m], base["items"][m], z)})
    return out


def format_paired(rows: list[dict]) -> str:
    """``paired`` as aligned text (empty without rows)."""
    if not rows:
        return ""
    w = max([14] + [len(r["task"]) for r in rows])
    head = (f"{'model - ' + rows[0]['reference']:<40} {'task':<{w}} {'metric':<8} {'diff':>8}   {'stderr':>7} "
            f"{'95 % interval':>19} {'n':>6} {'only this':>9} {'only ref':>8}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['model'][-40:]:<40} {r['task']:<{w}} {r['metric']:<8} {r['diff']:>+8.4f} ± {_fmt(r['stderr']):>7} "
                     f"[{r['low']:+.4f}, {r['high']:+.4f}] {r['n']:>6} {r['a_only']:>9} {r['b_only']:>8}")
    return "\n".join(lines)


def format_table(docs: list[dict]) -> str:
    """Every model's results as aligned text: task, metric, value ± stderr, n, chance, above chance."""
    w = max([14] + [len(t) for d in docs for t in d["tasks"]])
    head = f"{'model':<28} {'task':<{w}} {'metric':<10} {'value':>8}   {'stderr':>7} {'n':>6} {'shots':>5} {'chance':>7}  above"
    rows = [head, "-" * len(head)]
    for doc in docs:
        name = _name(doc)
        for task, r in doc["tasks"].items():
            keys = [r["metric"]] + [k for k in ("acc", "acc_norm", "acc_uncond", "greedy", "acc_seen", "acc_unseen")
                                    if k in r and k != r["metric"]]
            for k in keys:
                flag = {True: "yes", False: "no", None: "-"}[above_chance({**r, "metric": k})]
                rows.append(f"{name[-28:]:<28} {task:<{w}} {k:<10} {_fmt(r[k]):>8} ± {_fmt(r.get(k + '_stderr')):>7} "
                            f"{r.get('n_' + k, r['n']):>6} {r.get('shots', 0):>5} {_fmt(r.get('chance_' + k, r.get('chance'))):>7}  {flag}")
    return "\n".join(rows)


def draw_comparison(docs: list[dict], path: Path) -> None:
    """Grouped bars of each task's primary metric per model, with ±1 stderr and the chance level;
    accuracies (higher is better) and bits per byte (lower is better) on panels of their own."""
    from ..runtime.plotting import pyplot, save

    plt = pyplot()

    tasks = list(dict.fromkeys(t for d in docs for t in d["tasks"]))
    metric = {t: next(d["tasks"][t].get("metric", "?") for d in docs if t in d["tasks"]) for t in tasks}
    panels = [(label, [t for t in tasks if (metric[t] == "bpb") == is_bpb])
              for label, is_bpb in (("accuracy (dotted: chance)", False), ("bits per byte (lower is better)", True))]
    panels = [(label, group) for label, group in panels if group]
    fig, axes = plt.subplots(1, len(panels), squeeze=False, width_ratios=[len(g) for _, g in panels],
                             figsize=(max(5.0, 1.1 * len(tasks) + 2), 3.8))
    for ax, (label, group) in zip(axes[0], panels):
        _bars(ax, docs, group, metric)
        ax.set_ylabel(label)
    axes[0][0].legend(fontsize=7)
    save(fig, path, dpi=120)


def _bars(ax, docs: list[dict], tasks: list[str], metric: dict[str, str]) -> None:
    import numpy as np

    width = 0.8 / len(docs)
    for i, doc in enumerate(docs):
        vals = [doc["tasks"].get(t, {}).get(metric[t], np.nan) for t in tasks]
        errs = [doc["tasks"].get(t, {}).get(f"{metric[t]}_stderr", 0) for t in tasks]
        ax.bar(np.arange(len(tasks)) + (i - (len(docs) - 1) / 2) * width, np.asarray(vals, dtype=float), width,
               yerr=np.nan_to_num(np.asarray(errs, dtype=float)), capsize=2, label=Path(doc["model"]["path"]).name)
    for j, t in enumerate(tasks):
        chance = docs[0]["tasks"].get(t, {}).get("chance")
        if chance is not None:
            ax.hlines(chance, j - 0.45, j + 0.45, colors="k", linestyles="dotted", linewidth=1)
    ax.set_xticks(range(len(tasks)), [f"{t}\n({metric[t]})" for t in tasks], fontsize=7, rotation=30)


def plot_paths(output: Path, docs: list[dict]) -> dict[str, Path]:
    """Where the PNGs of a results file go: ``<stem>.compare.png`` (several models) and
    ``<stem>.needle[.<i>].png`` (one per model with a needle result)."""
    output = Path(output)
    out = {"compare": output.with_suffix(".compare.png")} if len(docs) > 1 else {}
    needles = [i for i, d in enumerate(docs) if "needle" in d["tasks"]]
    for i in needles:
        out[f"needle{i}"] = output.with_suffix(f".needle.{i}.png" if len(docs) > 1 else ".needle.png")
    return out


def evaluate_paths(paths: list[str], task_spec: str, shots: int = 0, limit: int | None = None, seed: int = 0,
                   output: Path | None = None, cache_dir: Path | None = None, batch_size: int = 64,
                   progress: bool = True, **load_kw) -> tuple[list[dict], list[Path]]:
    """Evaluate every model of ``paths`` (``models.load_lm(path, **load_kw)``) on the tasks of
    ``task_spec``; write the results file and its PNGs when ``output`` is given.
    Returns ``(documents, written files)``."""
    from .models import load_lm
    from .tasks import resolve_tasks
    from .tasks.needle import draw_heatmap

    tasks = resolve_tasks(task_spec)  # bad names fail before any model loads
    if limit is not None and limit <= 0:
        raise ValueError(f"--limit must be positive, got {limit}")
    settings = {"shots": shots, "limit": limit, "seed": seed, "tasks": [t.name for t in tasks],
                **{k: str(v) for k, v in load_kw.items() if v is not None}}
    docs = []
    for path in paths:
        lm = load_lm(path, batch_size=batch_size, **{k: v for k, v in load_kw.items() if v is not None})
        results = evaluate_model(lm, tasks, shots, limit, seed, cache_dir, batch_size, progress)
        docs.append(results_document(path, lm.identity, results, settings, lm.max_length))
        del lm
    written: list[Path] = []
    if output is not None:
        write_results(Path(output), docs)
        written.append(Path(output))
        for key, png in plot_paths(Path(output), docs).items():
            if key == "compare":
                draw_comparison(docs, png)
            else:
                doc = docs[int(key[len("needle"):])]
                draw_heatmap(doc["tasks"]["needle"], png, Path(doc["model"]["path"]).name)
            written.append(png)
    return docs, written
