"""The calibration grid (``bench_insertion_grid.py``) as a docs table and a README cell.

Which entry is the default of ``stemlm convert --init calibrate`` is read from ``CalibrationConfig``
itself (every setting but the token count, which the grid fixes), so the README says what the
current default measured, not what was the default when the grid ran.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GRID = ROOT / "benchmarks" / "results" / "insertion_grid.json"
DISTILL_SPEED = ROOT / "benchmarks" / "results" / "distill_speed.json"
DISTILL_MINUTES_GOAL = 10  # issue 37: local distillation of SmolLM2-135M in <= 10 min on 2 CPU cores
OOD_GOAL, DISTILLED_GOAL = 1.0, 0.5  # nats above dense at step 0, out of the calibration domain
NOT_COMPARED = {"tokens", "device", "seq_len", "chunk", "down_iters"}  # fixed by the grid, or not part of the fit
# What an entry's settings left out meant when the grid's first entries were written (the CalibrationConfig defaults
# of the time); entries written since record every setting, so a later change of the defaults cannot relabel them.
MEASURED_BASE = {"refit_down": False, "shrink": 0.0, "layer_choice": "uniform", "distill_rows": "dense",
                 "distill_precision": "fp32"}


def _settings(calibration: dict) -> dict:
    from stemlm.insert.calibrate import CalibrationConfig

    full = asdict(CalibrationConfig(**{**MEASURED_BASE, **calibration, "device": "cpu"}))
    return _compared(full)


def _compared(settings: dict) -> dict:
    """The settings that tell conversions apart (distillation's row update and precision only where it ran)."""
    unused = {"distill_rows", "distill_precision"} if not settings.get("distill_steps") else set()
    return {k: v for k, v in settings.items() if k not in NOT_COMPARED | unused}


def default_entry(runs: dict) -> dict | None:
    """The grid entry measured with the current defaults of ``convert --init calibrate`` on the default
    calibration text (None if absent)."""
    from stemlm.insert.calibrate import CalibrationConfig

    want = _compared(asdict(CalibrationConfig()))
    matches = [r for r in runs.values() if "calibration" in r and not _other_text(r)  # the default text
               and _settings(r["calibration"]) == want]
    full = [r for r in matches if r["calibration"].get("tokens") == CalibrationConfig.tokens]  # the token count too
    return (full or matches or [None])[0]


def _other_text(r: dict) -> bool:
    """Whether the entry calibrated on other text than the offline corpus alone (``-mixed``, ``-wide``)."""
    return bool(r.get("calib_mixed_sources") or r.get("calib_wide_sources"))


def distilled_entries(runs: dict) -> list[dict]:
    """Grid entries with local distillation, best out of domain first."""
    return sorted((r for r in runs.values() if r.get("calibration", {}).get("distill_steps")),
                  key=lambda r: r["delta_ood_mean"])


def _distilled_parts(c: dict) -> list[str]:
    """What local distillation trained, from an entry's calibration settings."""
    return ["rows"] + (["W_d"] if c.get("distill_down") else []) + (["W_g"] if c.get("distill_gate") else [])


def _describe(r: dict) -> str:
    c = r["calibration"]
    parts = [c.get("method", "gated"), "layer by layer" if c.get("sequential", True) else "parallel (dense hidden states)"]
    if c.get("layer_choice") == "cheapest":
        layers = r.get("converted_layers")
        parts.append("cheapest layers" + (f" ({', '.join(map(str, layers))})" if layers else ""))
    if c.get("als_rounds"):
        parts.append(f"ALS × {c['als_rounds']} (CG {c.get('down_iters', 8)} iters)")
    elif c.get("refit_down"):
        parts.append("W_d refit" + (" towards the dense stream" if c.get("correct_drift") else ""))
    parts.append(f"unseen {c.get('unseen', 'pooled')}")
    if c.get("shrink"):
        parts.append(f"shrink {c['shrink']:g}")
    if c.get("distill_steps"):
        parts.append(f"distilled {c['distill_steps']} steps × {c.get('distill_batch', 2048)} tokens"
                     + (f" at lr {c['distill_lr']:g}" if "distill_lr" in c else "")
                     + f" ({' + '.join(_distilled_parts(c))})"
                     + {"lazy": ", lazy row updates", "catchup": ", catch-up row updates"}.get(
                         c.get("distill_rows", "dense"), "")
                     + (f", {c['distill_precision']} GEMMs" if c.get("distill_precision", "fp32") != "fp32" else "")
                     + (" towards the dense stream" if c.get("correct_drift") else ""))
    if r.get("calib_mixed_sources"):
        parts.append("calibrated on corpus + news + stories")
    if r.get("calib_wide_sources"):
        left_out = r["calib_wide_sources"].get("excluded") or []
        parts.append("calibrated on corpus + the wide corpus's sources"
                     + (f" less {', '.join(left_out)}" if left_out else ""))
    return ", ".join(parts)


def grid_section(path: Path = GRID) -> list[str]:
    """The docs table of the grid, or ``[]`` before it has run."""
    if not path.exists():
        return []
    g = json.loads(path.read_text())
    dense, runs = g["runs"]["dense"], {k: v for k, v in g["runs"].items() if k != "dense"}
    ev, src = g["eval"], g["sources"]
    default = default_entry(runs)
    out = ["", "### Step 0 in and out of the calibration domain: the grid behind the default", "",
           f"`python benchmarks/bench_insertion_grid.py --python-doc python3.11-doc_*.deb`: SmolLM2-135M → STEM-1/3, "
           f"calibrated on the offline corpus (Wikipedia prose), {_tokens(runs)} calibration tokens. Held-out: "
           f"{ev['in_domain_batches'] * 1024:,} tokens of the corpus's validation split (in domain) and "
           f"{ev['ood_batches'] * 1024:,} tokens each of technical prose ({src['technical']['source']}, "
           f"{src['technical']['licence']}, sha256 `{src['technical']['sha256'][:12]}…`) and legal prose "
           f"({src['legal']['source']}, sha256 `{src['legal']['sha256'][:12]}…`). Dense: in domain "
           f"**{dense['in_domain']:.3f}**, technical **{dense['technical']:.3f}**, legal **{dense['legal']:.3f}** nats. "
           f"Times on the shared 2-core machine with the threads shown (the layer choice's scoring pass included); "
           f"for comparison only.", "",
           "| setting | calibration tokens | in domain Δ | technical Δ | legal Δ | out of domain Δ (mean) | time |",
           "|---|---:|---:|---:|---:|---:|---:|"]
    for r in sorted(runs.values(), key=lambda r: r["delta_ood_mean"]):
        mark = " **(default)**" if r is default else ""
        d = r["delta"]
        threads = r.get("threads", 1)  # entries before per-entry threads all ran with one
        out.append(f"| {_describe(r)}{mark} | {r['calib_tokens']:,} | {d['in_domain']:+.2f} | {d['technical']:+.2f} | "
                   f"{d['legal']:+.2f} | **{r['delta_ood_mean']:+.2f}** | {r['calib_seconds'] / 60:.1f} min "
                   f"({threads} thread{'s' if threads > 1 else ''}) |")
    out += [""] + goal_lines(runs) + oracle_lines(runs) + placement_lines(runs)
    return out


ORACLE_ROWS = (("rare<1", "ids the calibration never showed"), ("rare<16", "ids it showed < 16 times"),
               ("rare<256", "ids it showed < 256 times"), ("frequent>=16", "ids it showed ≥ 16 times"))


def oracle_lines(runs: dict) -> list[str]:
    """Where each measured entry's step-0 gap sits (``--oracle``): the gap with the dense FFN put back at some
    positions of the converted layers, by how often the calibration text showed the position's input id."""
    measured = [r for r in runs.values() if r.get("oracle")]
    if not measured:
        return []
    out = ["", "#### Where the step-0 gap sits: the positions of ids the calibration rarely saw", "",
           "`bench_insertion_grid.py --oracle`: the same held-out tokens scored again with the dense model's FFN "
           "output put back in every converted layer at some positions (by how often the calibration text showed "
           "the position's input id; share of held-out positions in brackets). It is not a row any fit could "
           "reach (the dense FFN output there depends on the context, a row does not); it shows which positions "
           "hold the gap, the positions after them included. With the dense FFN everywhere the model is the "
           "dense one (gap 0, checked).", "",
           "| entry | held-out text | as converted | " + " | ".join(f"dense FFN at {label}" for _, label in ORACLE_ROWS)
           + " |", "|---|---|---:|" + "---:|" * len(ORACLE_ROWS)]
    for r in measured:
        for domain, o in r["oracle"].items():
            share = dict(o.get("positions", {}))
            if "rare<16" in share:
                share["frequent>=16"] = 1 - share["rare<16"]
            cells = [f"{o[k]:+.2f}" + (f" ({share[k]:.0%})" if k in share else "") for k, _ in ORACLE_ROWS]
            out.append(f"| {_describe(r)} | {domain.replace('_', ' ')} | {o['plain']:+.2f} | " + " | ".join(cells) + " |")
    return out


def placement_lines(runs: dict) -> list[str]:
    """The per-layer costs the cheapest layers were chosen by (the entry with the most calibration tokens),
    as a plot with the uniform placement beside the chosen one, and the paired comparison of the two."""
    chosen = sorted((r for r in runs.values() if r.get("layer_costs")), key=lambda r: -r["calib_tokens"])
    if not chosen:
        return []
    r = chosen[0]
    costs, layers = r["layer_costs"], r["converted_layers"]
    from stemlm.config import resolve_stem_layers

    uniform = list(resolve_stem_layers(r["layers"], len(costs)))
    out = ["", "#### Which layers: each layer's cost alone", "",
           f"`--layer-choice cheapest` (the default) measures, for every layer of the dense model, the KL of its "
           f"next-token distribution when that layer alone is converted (rows fitted as above), and converts the "
           f"{len(layers)} layers of least cost: {', '.join(map(str, layers))} (sum of their single-layer costs "
           f"{sum(costs[i] for i in layers):.2f} nats) instead of the uniform {r['layers']} placement's "
           f"{', '.join(map(str, uniform))} ({sum(costs[i] for i in uniform):.2f}). Costs from the "
           f"{r['calib_tokens']:,}-token entry."]
    pairs = []
    for c in runs.values():  # the same setting with uniform layers: the paired effect of the choice
        cal = c.get("calibration", {})
        if c is r or cal.get("layer_choice", "uniform") != "uniform" or _other_text(c):
            continue
        if {k: v for k, v in cal.items() if k != "layer_choice"} == {k: v for k, v in r["calibration"].items()
                                                                      if k != "layer_choice"}:
            pairs.append(c)
    for c in pairs:
        out.append(f"Against the uniform layers with the same settings: in domain {c['delta']['in_domain']:+.2f} → "
                   f"{r['delta']['in_domain']:+.2f}, technical {c['delta']['technical']:+.2f} → "
                   f"{r['delta']['technical']:+.2f}, legal {c['delta']['legal']:+.2f} → {r['delta']['legal']:+.2f} "
                   f"nats over dense (the same held-out tokens).")
    plot = _cost_plot(costs, layers, uniform)
    if plot is not None:
        out += ["", f"![per-layer cost of conversion](../{plot.relative_to(ROOT).as_posix()})"]
    return out


def _cost_plot(costs: list[float], chosen: list[int], uniform: list[int]) -> Path | None:
    from _edit_report import pyplot_or_none
    from stemlm.runtime.plotting import save

    plt = pyplot_or_none()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(8, 3.2))
    kept = [i for i in range(len(costs)) if i not in chosen]
    ax.bar(chosen, [costs[i] for i in chosen], color="tab:green", label="converted (the cheapest)")
    ax.bar(kept, [costs[i] for i in kept], color="tab:grey", label="kept dense")
    ax.scatter(uniform, [costs[i] for i in uniform], marker="v", color="tab:red", zorder=3, label="uniform placement")
    ax.set(xlabel="layer", ylabel="KL a token, that layer alone (nats)",
           title="SmolLM2-135M: cost of converting one layer to STEM at step 0")
    ax.legend(fontsize=8)
    return save(fig, ROOT / "results" / "insertion" / "layer_costs.png", dpi=110)


def _tokens(runs: dict) -> str:
    toks = sorted({r["calib_tokens"] for r in runs.values() if "calib_tokens" in r})
    return ", ".join(f"{t:,}" for t in toks)


def goal_lines(runs: dict) -> list[str]:
    """The issue's step-0 goals, read against the current default and the best distilled entry."""
    default, distilled = default_entry(runs), distilled_entries(runs)
    lines = []
    if default is None:
        lines.append("The current default of `convert --init calibrate` is not in the grid.")
    else:
        ok = default["delta_ood_mean"] <= OOD_GOAL
        lines.append(f"Default flags, out of domain: **{default['delta_ood_mean']:+.3f} nats** (goal ≤ +{OOD_GOAL:g}: "
                     f"{'met' if ok else 'not met'}).")
    if distilled:
        best = distilled[0]
        ok = best["delta_ood_mean"] <= DISTILLED_GOAL
        lines.append(f"After local distillation, out of domain: **{best['delta_ood_mean']:+.2f} nats** "
                     f"(goal ≤ +{DISTILLED_GOAL:g}: {'met' if ok else 'not met'}).")
    return lines


def readme_cell(g: dict) -> tuple[str, str]:
    """``(measured, verdict)`` of the README row: the step-0 goal (default flags) and the distilled goal (the best
    distilled entry) judged apart."""
    runs = {k: v for k, v in g["runs"].items() if k != "dense"}
    default, distilled = default_entry(runs), distilled_entries(runs)
    cells, verdicts = [], []
    if default is not None:
        cells.append(f"default flags ({_describe(default)}): out of domain **{default['delta_ood_mean']:+.3f}**, "
                     f"in domain {default['delta']['in_domain']:+.2f}")
        verdicts.append(f"step 0, default flags: {'yes' if default['delta_ood_mean'] <= OOD_GOAL else 'no'}")
    else:
        verdicts.append("step 0, default flags: not measured")
    if distilled:
        b = distilled[0]
        c = b["calibration"]
        how = f", {' and '.join(_distilled_parts(c)[1:])} too" if len(_distilled_parts(c)) > 1 else ""
        how += ", calibrated on the wide corpus's text" if b.get("calib_wide_sources") else ""
        cells.append(f"best distilled ({c['distill_steps']} steps{how}): out of domain **{b['delta_ood_mean']:+.2f}**, "
                     f"in domain {b['delta']['in_domain']:+.2f}")
        verdicts.append(f"after local distillation: {'yes' if b['delta_ood_mean'] <= DISTILLED_GOAL else 'no'}")
    else:
        verdicts.append("after local distillation: not measured")
    d = g["runs"]["dense"]
    at = f"{_tokens(runs)} calibration tokens; " if runs else ""
    return (at + f"dense {d['in_domain']:.2f} / {d['technical']:.2f} / {d['legal']:.2f} (in domain / technical / legal); "
            + "; ".join(cells) + " ([docs](docs/insertion.md#step-0-in-and-out-of-the-calibration-domain-the-grid-behind-the-default))",
            "; ".join(verdicts))


def distill_speed_section(path: Path = DISTILL_SPEED) -> list[str]:
    """The docs table of ``bench_distill_speed.py``: each implementation's step time, fixed cost, error and
    projection to the recipe's ten layers × 2,000 steps, or ``[]`` before it has run."""
    import statistics

    if not path.exists():
        return []
    from bench_distill_speed import default_implementation

    r = json.loads(path.read_text())
    default, base = default_implementation(r), r["ratio_to"]
    med = statistics.median
    g = r.get("gemm_gflops", {})
    out = ["", "### Local distillation speed", "",
           f"`python benchmarks/bench_distill_speed.py` (at `{r['git_commit']}`, {r['threads']} threads): layer "
           f"{r['layer']} of SmolLM2-135M fitted as `convert` fits it on {r['calib_tokens']:,} calibration tokens "
           f"({r['unique_rows']:,} rows × {r['d_ff']} train, with `W_d` and `W_g`), then distilled for {r['steps']} "
           f"steps × {r['batch']:,} tokens at lr {r['lr']:g} by each implementation, {r['rounds']} interleaved rounds. A "
           "step's time is the step loop's own (`distill_layer`'s `seconds_steps`); the rest of a run (the dense "
           "layer's output and the output error over every calibration token before and after) is its fixed cost. "
           "The projection is ten layers × (2,000 steps + the fixed cost), the recipe's distillation; the calibration "
           "pass around it (the capture, the fit, the `W_d` refit) is not in it."
           + (f" This CPU's GEMM at a step's shape ({r['batch']:,} tokens × d × d_ff): fp32 {g['fp32']:.0f}, bf16 "
              f"{g['bf16']:.0f} GFLOP/s." if g else ""), "",
           "| implementation | ms a step (median; rounds) | ÷ " + base + " | fixed s a run | output error after the steps "
           "| projected minutes |", "|---|---:|---:|---:|---:|---:|"]
    for name, sec in r["seconds_per_step"].items():
        ms = [x * 1e3 for x in sec]
        ratio = f"{r['step_ratio_median'][name]:.2f}" if name in r["step_ratio_median"] else "1"
        mark = " **(default)**" if name == default else ""
        out.append(f"| {name}{mark} | {med(ms):.1f} ({min(ms):.1f}–{max(ms):.1f}) | {ratio} | "
                   f"{med(r['fixed_seconds_per_run'][name]):.1f} | {med(r['error_after'][name]):.5f} | "
                   f"{r['projected_minutes_10_layers_2000_steps'][name]:.1f} |")
    minutes = r["projected_minutes_10_layers_2000_steps"][default]
    out += ["", f"The default ({default}) projects to **{minutes:.1f} min** of distillation for the recipe on "
            f"{r['threads']} cores: the goal (≤ {DISTILL_MINUTES_GOAL} min on 2 CPU cores) is "
            f"**{'met' if minutes <= DISTILL_MINUTES_GOAL else 'not met'}** by this projection from one layer."]
    runs = json.loads(GRID.read_text())["runs"] if GRID.exists() else {}
    before, now = (runs.get(f"{RECIPE}{tail}@1/3") for tail in ("", "-catchup-bf16"))
    if before and now:
        pairs = [(int(a.split("layer ")[1].split(":")[0]), float(a.rsplit("-> ", 1)[1].split()[0]),
                  float(b.rsplit("-> ", 1)[1].split()[0]))
                 for a, b in zip(*([x for x in e["log"] if "local distillation" in x] for e in (before, now)))]
        out += ["", "Whole conversions with the recipe, the grid's entries above (`bench_insertion_grid.py --grid "
                f"{RECIPE},{RECIPE}-catchup-bf16`): dense fp32 row steps **{before['delta_ood_mean']:+.4f}** out of "
                f"domain, {before['delta']['in_domain']:+.4f} in domain, in {before['calib_seconds'] / 60:.0f} min "
                f"({before['threads']} threads, part of it beside a test run); catch-up rows and bf16 GEMMs "
                f"**{now['delta_ood_mean']:+.4f}** / {now['delta']['in_domain']:+.4f} in "
                f"{now['calib_seconds'] / 60:.0f} min ({now['threads']} thread{'s' if now['threads'] > 1 else ''}), "
                "the calibration pass included. Each converted layer's output error after distillation, dense / "
                f"catch-up (their logs): {'; '.join(f'layer {i} {a:.4f} / {b:.4f}' for i, a, b in pairs)}; the "
                f"largest difference {max(abs(a - b) for _, a, b in pairs):.4f}."]
    timed = timed_distillation(runs)
    if timed:
        out += ["", f"Timed whole (`--grid {RECIPE}-catchup-bf16-timed --threads {timed['threads']}`): the ten layers' "
                f"distillation took **{timed['minutes'] * 60:.0f} s = {timed['minutes']:.2f} min** in all "
                f"({timed['step_minutes']:.1f} min of them "
                f"steps; per layer {min(timed['seconds']):.0f}–{max(timed['seconds']):.0f} s), the whole calibration "
                f"pass {timed['calib_minutes']:.1f} min; out of domain {timed['delta_ood_mean']:+.4f}. The goal "
                f"(≤ {DISTILL_MINUTES_GOAL} min) is **{'met' if timed['minutes'] <= DISTILL_MINUTES_GOAL else 'not met'}"
                "** by the conversion itself (one run; by "
                f"{abs(DISTILL_MINUTES_GOAL - timed['minutes']) * 60:.0f} s: a busier machine could land on the "
                "other side)."]
    return out


RECIPE = "default-262k-wide-distill-gate-2000"  # the best distilled conversion measured (2026-11-29)


def timed_distillation(runs: dict) -> dict | None:
    """The recipe's conversion with the distillation defaults, run to time it (``…-catchup-bf16-timed``): its
    layers' distillation seconds from its log (``layer N: local distillation, … in S s (T s of steps)``)."""
    e = runs.get(f"{RECIPE}-catchup-bf16-timed@1/3")
    if not e:
        return None
    lines = [x for x in e["log"] if "local distillation" in x and " s of steps)" in x]
    seconds = [float(x.rsplit(" in ", 1)[1].split(" s ")[0]) for x in lines]
    steps = [float(x.rsplit("(", 1)[1].split(" s of steps")[0]) for x in lines]
    return {"seconds": seconds, "minutes": sum(seconds) / 60, "step_minutes": sum(steps) / 60,
            "calib_minutes": e["calib_seconds"] / 60, "threads": e["threads"], "delta_ood_mean": e["delta_ood_mean"],
            "git_commit": e["git_commit"]}
