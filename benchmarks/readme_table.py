"""Regenerate the results table of README.md from the results JSON.

    python benchmarks/readme_table.py            # rewrite the table between the marker comments
    python benchmarks/readme_table.py --check    # exit 1 if README.md's table is out of date

The table sits between ``<!-- results:begin ... -->`` and ``<!-- results:end -->`` in README.md.
Each row is one formatter, registered with ``@row(goal, script, *results)``:

* ``goal``: the goal's text, written from the same constant the formatter checks against;
* ``script``: the benchmark that writes the results;
* ``results``: paths relative to the repository root of the JSON the row is read from. A glob
  (``train_step*.json``) gives ``{path: JSON}`` of every match; ``FILE#KEY`` gives the entry
  ``KEY`` of the file (one run of ``edit_eval.json``). ``*.quick.json`` never matches.

The formatter receives the loaded results in that order and returns ``(measured, met)``: the
measured cell and the "goal met?" cell, both computed from the JSON. The benchmark cell (script,
links to the JSON, the commit each was measured at) is built from ``results``. A row whose results do not
exist yet is left out, with a note on stderr, so a formatter can be written before its first run.

To add a row, e.g. for ``bench_foo.py`` writing ``benchmarks/results/foo.json`` = ``{"ratio": ...}``::

    FOO_GOAL = 2.0

    @row(f"P9 foo ≥ {FOO_GOAL:g}× faster than bar", "bench_foo.py", RES + "foo.json")
    def foo(r: dict) -> tuple[str, str]:
        return f"**{r['ratio']:.2f}×** ([docs](docs/foo.md))", yes(r["ratio"] >= FOO_GOAL)

Rows appear in the order they are defined; ``yes``, ``pct``, ``ms``, ``sci`` and ``span`` format
cells; the registry, the loading and the table's place in README.md are in ``_results_table.py``.
Keep cells short: the explanation and the history of earlier runs belong on the docs page the cell
links to.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from _edit_report import edit_settings
from _insertion_grid_report import DISTILL_MINUTES_GOAL, DISTILLED_GOAL, OOD_GOAL, readme_cell as grid_readme_cell
from _results_table import (CLAIMS_BEGIN, CLAIMS_END, RES, ROOT, ms, pct, render, render_claims, replace_table, row,
                            sci, span, yes)


# ---------------------------------------------------------------- the rows

GAP_GOAL = 0.03


@row(f"P1 train step STEM-full ÷ dense within {pct(GAP_GOAL, 0)} of the FLOP ratio", "bench_train_step.py",
     RES + "train_step.json", RES + "train_step*.json")
def train_step(base: dict, runs: dict) -> tuple[str, str]:
    from bench_train_step import width_sweep

    sweep = width_sweep(list(runs.values()), base)  # the widths measured like the default shape
    label = {w: f"d={w}" + (f" ({r['preset']})" if not r["overrides"] else "") for w, r in sweep}
    own = [r["seconds_per_step"]["stem_own"] / r["seconds_per_step"]["stem"] for _, r in sweep]
    gaps = ", ".join(f"{label[w]} {100 * r['gap']:+.1f} %" for w, r in sweep)
    measured = (f"gap by backbone width ({base['batch_size']}×{base['seq_len']} tokens, median of per-round "
                f"ratios): **{gaps}** ([plot]({RES}train_step_widths.png)); STEM's own work {pct(own[0])} → "
                f"{pct(own[-1])} of its step ([why](docs/training.md#where-the-step-time-goes-p1-and-p7))")
    met = [label[w] for w, r in sweep if abs(r["gap"]) <= GAP_GOAL]
    missed = [label[w] for w, r in sweep if abs(r["gap"]) > GAP_GOAL]
    verdict = yes(not missed) if not (met and missed) else f"at {', '.join(met)} yes; at {', '.join(missed)} no"
    return measured, verdict


SPEEDUP_GOAL = 20
FUSED_GOAL = 7  # issue 27: the fused path's row AdamW against torch's fused dense AdamW


@row(f"P2 sparse ÷ dense table AdamW step ≥ {SPEEDUP_GOAL}× faster", "bench_sparse_optim.py",
     RES + "sparse_optim.json")
def sparse_optim(r: dict) -> tuple[str, str]:
    m = r["main"]
    measured = (f"V={m['V']}, d_ff={m['d_ff']}, U={m['unique']}: step {ms(m['sparse_step_s'])} (eager) / "
                f"{ms(m['sparse_compiled_step_s'])} (`compile=True`) vs torch AdamW defaults "
                f"{ms(m['dense_step_s'], 0)}: {m['dense_over_sparse_step']:.0f}× / "
                f"{m['dense_over_sparse_compiled_step']:.0f}×; vs `fused=True` {ms(m['dense_fused_step_s'], 0)}: "
                f"{m['dense_fused_over_sparse_step']:.1f}× / {m['dense_fused_over_sparse_compiled_step']:.1f}×; "
                f"lookup + backward + step {m['dense_over_sparse_total']:.0f}× / "
                f"{m['dense_over_sparse_compiled_total']:.0f}× ([docs](docs/training.md#table-optimizer-sparse-vs-dense))")
    verdict = (f"{yes(m['dense_over_sparse_step'] >= SPEEDUP_GOAL)} vs torch defaults (the official setup); "
               f"{yes(m['dense_fused_over_sparse_step'] >= SPEEDUP_GOAL)} vs fused")
    if "sparse_fused_step_s" in m:  # the fused table path (issue 27), measured since it exists
        fused = m["dense_fused_over_sparse_fused_step"]
        measured += (f"; fused table path ([gpu.md](docs/gpu.md): one C++ row loop) {ms(m['sparse_fused_step_s'])}: "
                     f"**{fused:.1f}×** vs `fused=True`, {m['dense_over_sparse_fused_step']:.0f}× vs defaults")
        verdict += f"; fused path ≥ {FUSED_GOAL}× vs fused: {yes(fused >= FUSED_GOAL)}"
    return measured, verdict


MFU_GOAL = 0.5


@row(f"P3 MFU of `tiny` ≥ {pct(MFU_GOAL, 0)} of measured fp32 matmul peak", "bench_mfu.py", RES + "mfu.json")
def mfu(r: dict) -> tuple[str, str]:
    runs = r["runs"]
    measured = (f"dense {pct(runs['dense']['mfu'])}, STEM {pct(runs['stem']['mfu'])} (peak "
                f"{r['peak_flops'] / 1e9:.0f} GFLOP/s: the best of ATen and oneDNN, measured in the same run)")
    return measured, yes(all(x["mfu"] >= MFU_GOAL for x in runs.values()))


DISK_SPEED_GOAL, RSS_GOAL = 0.95, 0.9


@row(f"P4 decode with tables on disk ≥ {DISK_SPEED_GOAL}× RAM, RSS −{pct(RSS_GOAL, 0)} of table bytes",
     "bench_offload_decode.py", RES + "offload_decode.json", RES + "offload_decode_llama3.2-1b.json")
def offload_decode(r: dict, big: dict) -> tuple[str, str]:
    cfg, runs, summary = r["config"], r["runs"], r["summary"]
    cold, warm = summary["disk-cold"], summary["disk"]
    waits = " / ".join(ms(runs[k]["store"]["stall_seconds"], 0) for k in ("disk-cold", "disk"))
    rss = min(s["rss_saved_over_table_bytes"] for s in (cold, warm))
    same = all(s["same_tokens_as_ram"] for s in (cold, warm))
    big_run = big["runs"]["disk-cold"]
    measured = (f"{cfg['repeats']} rotated rounds × {cfg['gens']} generations, median of per-round disk ÷ RAM "
                f"ratios (ratio of medians): page cache dropped **{cold['speed_ratio_vs_ram']:.2f}× "
                f"({cold['speed_ratio_of_medians']:.2f})**, warm **{warm['speed_ratio_vs_ram']:.2f}× "
                f"({warm['speed_ratio_of_medians']:.2f})**; lookups waited {waits} in all (cold / warm); "
                f"{'same' if same else 'different'} tokens; RSS −{pct(rss)} of {cfg['table_bytes'] / 1e9:.2f} GB. "
                f"{big['config']['preset']} STEM-{big['config']['stem_layers']} with "
                f"{big['config']['table_bytes'] / 1e9:.1f} GB of tables "
                f"({big['summary']['disk-cold']['table_bytes_over_ram']:.2f}× RAM) decodes from disk at "
                f"{big_run['decode_tokens_per_s']:.2f} tok/s, RSS {big_run['rss_end']['VmRSS'] / 2**30:.1f} GiB "
                "([docs](docs/offload.md#measurements))")
    if all(s["speed_ratio_vs_ram"] >= DISK_SPEED_GOAL for s in (cold, warm)):
        speed = "yes"
    elif all(s["speed_ratio_of_medians"] >= DISK_SPEED_GOAL for s in (cold, warm)):
        speed = "no by the paired median, yes by the ratio of medians (the machine's noise: see docs)"
    else:
        speed = "no"
    return measured, f"RSS {yes(rss >= RSS_GOAL)}; speed {speed}"


HIT_GOAL, HIT_FRACTION = 0.9, 0.1
ONLINE = ("lfu_cold", "lfu_warm", "window_cold", "window_warm")


@row(f"P5 cache hit rate ≥ {pct(HIT_GOAL, 0)} at {pct(HIT_FRACTION, 0)} of rows (real corpus)", "bench_cache_hit.py",
     RES + "cache_hit.json", RES + "cache_hit_train.json")
def cache_hit(val: dict, train: dict) -> tuple[str, str]:
    def at(result, stream):
        return next(x for x in result["streams"][stream]["rows"] if x["fraction"] == HIT_FRACTION)

    def both(result, key):
        return " / ".join(f"{at(result, s)[key]:.3f}" for s in ("corpus", "smollm2"))
    v = {s: val["streams"][s]["vocab_size"] for s in ("corpus", "smollm2")}
    measured = (f"validation split, W-TinyLFU warm: V={v['corpus']} {at(val, 'corpus')['window_warm']:.3f}, "
                f"SmolLM2 V={v['smollm2']} {at(val, 'smollm2')['window_warm']:.3f} (LFU warm "
                f"{both(val, 'lfu_warm')}; Belady's optimum from an empty cache {both(val, 'belady_cold')}); "
                f"a {train['streams']['corpus']['tokens'] // 1000}k-token training stream: W-TinyLFU cold "
                f"{both(train, 'window_cold')} (static top-{pct(HIT_FRACTION, 0)} {both(train, 'static_oracle')}, "
                f"Belady {both(train, 'belady_cold')}) ([plot]({RES}cache_hit.png), "
                "[docs](docs/offload.md#measurements))")
    best = max(at(res, s)[k] for res in (val, train) for s in res["streams"] for k in ONLINE
               if at(res, s)[k] is not None)
    if best >= HIT_GOAL:
        return measured, "yes"
    return measured, (f"no (best {best:.3f}; SmolLM2's top {pct(HIT_FRACTION, 0)} of ids cover only "
                      f"{pct(at(train, 'smollm2')['static_oracle'])} of the training text)")


@row("P6 decode STEM ÷ dense vs parameter-byte ratio", "bench_stem_vs_dense_decode.py",
     RES + "stem_vs_dense_decode.json")
def stem_vs_dense_decode(r: dict) -> tuple[str, str]:
    d, prefill = r["decode"], r["prefill_disk_tier"]
    exact = all(p["bytes_ratio"] == 1 for p in prefill.values()) and r["decode_bytes_disk_tier"]["ratio"] == 1
    measured = (f"byte ratio {d['inverse_bytes_ratio']:.3f}; speed ratio **{d['speed_ratio_stem_over_dense']:.2f}×** "
                f"(median of {len(d['speed_ratio_rounds'])} alternating paired rounds, {span(d['speed_ratio_rounds'])}; "
                f"ratio of medians {d['speed_ratio_of_medians']:.2f}×); disk-tier prefill with prefetch overlap "
                + " / ".join(f"×{p['speedup_prefetch']:.3f}" for p in prefill.values())
                + f" (the gather is {span([1000 * p['gather_all_layers_s'] for p in prefill.values()], '.0f')} ms "
                f"of a {span([p['forward_sync_s'] for p in prefill.values()], '.1f')} s prefill); bytes moved = "
                f"formula {'exactly' if exact else 'not exactly'} ([docs](docs/offload.md#measurements))")
    return measured, "reported (no threshold)"


HF_GOAL = 1.3
GEMMS = {"aten": "ATen", "onednn": "oneDNN"}


@row(f"P7 training tokens/s stemlm ÷ HF Llama (sdpa) ≥ {HF_GOAL}×", "bench_vs_hf.py", RES + "vs_hf.json")
def vs_hf(r: dict) -> tuple[str, str]:
    tps = r["tokens_per_s"]
    other = "onednn" if "ratio_onednn" in r else "aten"  # the GEMMs that were not the default when it ran
    default = "the default `run.matmul=auto`'s pick on this CPU" if other == "aten" else "the default then"
    measured = (f"**{r['ratio']:.2f}×** (median of per-round ratios, {r['steps']} rounds; ratio of medians "
                f"{r['ratio_of_medians']:.2f}, of fastest steps {r['ratio_of_fastest']:.2f}): stemlm "
                f"({GEMMS[r['matmul']]} GEMMs, {default}) {tps['stemlm']:.0f} vs HF {tps['hf']:.0f} tok/s; in "
                f"the same rounds `run.matmul={other}` {r['ratio_' + other]:.2f}×, `run.compile=true` "
                f"{r['ratio_compiled']:.2f}×. Earlier runs and where "
                "the lead comes from: [docs](docs/training.md#where-the-step-time-goes-p1-and-p7)")
    return measured, f"eager: {yes(r['ratio'] >= HF_GOAL)}; with compiled blocks: {yes(r['ratio_compiled'] >= HF_GOAL)}"


EVAL_SPEED_GOAL, EVAL_DIFF_GOAL = 2, 1e-4


def eval_misses(r: dict) -> list[str]:
    """Which parts of the P8 goal a ``bench_eval_vs_harness`` result misses."""
    return [what for what, ok in (("speed", r["ratio"] >= EVAL_SPEED_GOAL),
                                  (f"the {sci(EVAL_DIFF_GOAL, 0)} agreement", r["max_abs_logprob_diff"] <= EVAL_DIFF_GOAL),
                                  ("accuracy", r["accuracies_identical"])) if not ok]


@row(f"P8 `stemlm eval` ÷ lm-eval `hf` backend ≥ {EVAL_SPEED_GOAL}× faster, per-request log-likelihoods within "
     f"{sci(EVAL_DIFF_GOAL, 0)}, identical accuracy", "bench_eval_vs_harness.py",
     RES + "eval_vs_harness_aten.json", RES + "eval_vs_harness.json", RES + "eval_agreement.json")
def eval_vs_harness(aten: dict, onednn: dict, agreement: dict) -> tuple[str, str]:
    acc = " / ".join(f"{a:.3f}" for a in aten["accuracy"]["stemlm"].values())
    same = "identical" if aten["accuracies_identical"] else "different"
    measured = (f"SmolLM2-135M fp32, {aten['n_requests']:,} {' + '.join(aten['tasks'])} requests, "
                f"{aten['rounds']} paired rounds: {GEMMS[aten['matmul']]} GEMMs (the default) **{aten['ratio']:.2f}×** "
                f"({min(aten['seconds']['stemlm']):.1f} s vs {min(aten['seconds']['harness_hf']):.1f} s, fastest "
                f"rounds), max difference {sci(aten['max_abs_logprob_diff'])}, accuracy {same} ({acc}); "
                f"{GEMMS[onednn['matmul']]} (`--matmul auto`) **{onednn['ratio']:.2f}×**, max difference "
                f"{sci(onednn['max_abs_logprob_diff'])}; all {len(agreement['tasks'])} multiple-choice tasks "
                f"({agreement['limit']} items each, {GEMMS[agreement['matmul']]}): {agreement['ratio']:.2f}×, "
                f"{sci(agreement['max_abs_logprob_diff'])}, accuracy "
                f"{'identical' if agreement['accuracies_identical'] else 'different'} "
                "([docs](docs/evaluation.md#speed-against-the-harnesss-hf-backend))")
    verdicts = [(f"{GEMMS[r['matmul']]}" + (f" ({len(r['tasks'])} tasks)" if r is agreement else "") + ": "
                 + (f"no (misses {', '.join(miss)})" if (miss := eval_misses(r)) else "yes"))
                for r in (aten, onednn, agreement)]
    return measured, "; ".join(verdicts)


SWAP_GOAL, LOCALITY_GOAL = 0.9, 0.99


def all_layers(run: dict, split: str) -> dict:
    """The swap evaluation of ``run`` on ``split`` with every table layer edited."""
    return next(x for x in run[f"swap_{split}"]["runs"] if x["layers_label"] == "all")


@row(f"knowledge edit: swap success ≥ {pct(SWAP_GOAL, 0)} on held-out phrasings, ≥ {pct(LOCALITY_GOAL, 0)} "
     "locality, exact undo", "bench_edit.py",
     RES + "edit_eval.json#r16_full_tlr30_emb0_s4000", RES + "edit_eval.json#r16_full_tlr30_s4000")
def edit(frozen: dict, trained: dict) -> tuple[str, str]:
    held, seen = all_layers(frozen, "heldout_template"), all_layers(frozen, "train")
    undo = "exact" if held["reversible"] == 1 else f"exact in {pct(held['reversible'])}"
    measured = (f"default corpus with each training fact ×16, input embedding frozen (`optim.embed_lr=0`), "
                f"{frozen['spec']['steps']} steps: **{pct(held['success'])}** held-out (n={held['known']}), "
                f"{pct(seen['success'])} trained; locality {pct(held['locality_top1'], 0)}; undo {undo}. "
                f"{pct(all_layers(trained, 'heldout_template')['success'])} / "
                f"{pct(all_layers(trained, 'train')['success'])} with the embedding trained "
                "([docs](docs/editing.md#results) has the recipe and what moves it)")
    ok = held["success"] >= SWAP_GOAL and held["locality_top1"] >= LOCALITY_GOAL and held["reversible"] == 1
    return measured, yes(ok)


STEP0_GOAL = 2.0  # nats above dense at step 0


@row(f"insertion: SmolLM2-135M → STEM-1/3 with calibrated tables, held-out loss at step 0 ≤ dense + {STEP0_GOAL:g} nats",
     "bench_insertion.py", RES + "insertion_step0.json")
def insertion(r: dict) -> tuple[str, str]:
    runs = list(r["runs"].values())
    dense = {x["eval_batches"]: x["loss"] for x in runs if x["setting"] == "dense"}
    cal = [x for x in runs if x.get("init") == "calibrate" and x.get("layers", "1/3") == "1/3"]
    best = min(cal, key=lambda x: x["loss"])
    other = {x["setting"]: x for x in runs if x.get("init") in ("project", "zero")}
    measured = (f"{best['eval_batches'] * 1024:,} held-out tokens, dense {dense[best['eval_batches']]:.2f}: best calibrated "
                f"(`{best['setting']}`, {best['calib_tokens']:,} calibration tokens) **{best['delta_vs_dense']:+.2f} nats**; "
                + ", ".join(f"{k} {v['delta_vs_dense']:+.2f}" for k, v in other.items())
                + " ([docs](docs/insertion.md#measurements))")
    return measured, yes(best["delta_vs_dense"] <= STEP0_GOAL)


@row(f"insertion with the default `convert --init calibrate` (SmolLM2-135M → STEM-1/3), step 0 on held-out text outside "
     f"the calibration domain: ≤ dense + {OOD_GOAL:g} nats; after local distillation ≤ + {DISTILLED_GOAL:g}",
     "bench_insertion_grid.py", RES + "insertion_grid.json")
def insertion_grid(g: dict) -> tuple[str, str]:
    return grid_readme_cell(g)


@row(f"local distillation of SmolLM2-135M → STEM-1/3 (the best recipe measured: 10 layers × 2,000 steps × 1,024 tokens, "
     f"rows + W_d + W_g) ≤ {DISTILL_MINUTES_GOAL} min on 2 CPU cores", "bench_distill_speed.py",
     RES + "distill_speed.json")
def distill_speed(r: dict) -> tuple[str, str]:
    # the timed whole conversion is read here, not registered as this row's result: the row's re-measurements
    # (bench-check) are distill_speed's, not the grid's step-0 figures
    from _insertion_grid_report import GRID, timed_distillation
    from bench_distill_speed import default_implementation

    default, base = default_implementation(r), r["ratio_to"]
    ms = {name: statistics.median(v) * 1e3 for name, v in r["seconds_per_step"].items()}
    minutes = r["projected_minutes_10_layers_2000_steps"]
    others = ", ".join(f"{name} {ms[name]:.0f} ms ({minutes[name]:.0f} min)" for name in ms if name not in (default, base))
    measured = (f"layer {r['layer']} fitted as convert fits it ({r['unique_rows']:,} rows × {r['d_ff']} train), "
                f"{r['steps']} steps × {r['batch']} tokens, {r['rounds']} interleaved rounds, median a step (projected "
                f"10 layers × 2,000 steps with each run's fixed cost): **{default}** (the default) **{ms[default]:.0f} ms, "
                f"{minutes[default]:.1f} min**, {r['step_ratio_median'][default]:.2f}× the step of {base} "
                f"({ms[base]:.0f} ms, {minutes[base]:.0f} min); {others}; output error after the steps "
                f"{statistics.median(r['error_after'][default]):.4f} vs {statistics.median(r['error_after'][base]):.4f} "
                f"([docs](docs/insertion.md#local-distillation-speed))")
    timed = timed_distillation(json.loads(GRID.read_text())["runs"]) if GRID.exists() else None
    if timed is None:
        return measured, yes(minutes[default] <= DISTILL_MINUTES_GOAL) + " (projected from one layer)"
    measured += (f"; a whole conversion with the defaults (`bench_insertion_grid.py`, {timed['threads']} threads, at "
                 f"`{timed['git_commit'][:7]}`): **{timed['minutes'] * 60:.0f} s = {timed['minutes']:.2f} min** of "
                 "distillation in all (one run), out of domain "
                 f"{timed['delta_ood_mean']:+.3f}")
    return measured, (f"projected: {yes(minutes[default] <= DISTILL_MINUTES_GOAL)}; whole conversion: "
                      f"{yes(timed['minutes'] <= DISTILL_MINUTES_GOAL)}")


@row("mid-training insertion on one GPU (SmolLM2-135M, ≤ 10 min, ≥ 50M tokens): STEM-1/3 below dense continued",
     "gpu_midtrain.py", RES + "gpu_midtrain/*.json")
def gpu_midtrain(files: dict) -> tuple[str, str]:
    from _gpu_midtrain_report import readme_cell

    measured, met = readme_cell(files)
    return measured, yes(met)


CPU_MIDTRAIN_GAP_GOAL, ZERO_SHOT_POINTS_GOAL = 0.25, 1.0  # issue 37: after 300k tokens on the CPU; within 1 point


@row(f"mid-training with distillation on the CPU (SmolLM2-135M → STEM-1/3, locally distilled conversion, KL to the "
     f"dense model): ≤ dense continued + {CPU_MIDTRAIN_GAP_GOAL:g} nats after 300k tokens; zero-shot within "
     f"{ZERO_SHOT_POINTS_GOAL:g} point of dense continued on each task", "midtrain_longer.py",
     RES + "midtrain_longer_*.json")
def cpu_midtrain(files: dict) -> tuple[str, str]:
    def pairs(rows: list[dict]) -> str:
        return " / ".join(f"{100 * r['diff']:+.1f} [{100 * r['low']:+.1f}, {100 * r['high']:+.1f}]" for r in rows)

    runs = sorted(files.values(), key=lambda r: r["summaries"]["dense"]["tokens_seen"])
    first = runs[0]["at_307k"]
    parts = [f"validation gap to dense continued and zero-shot distilled − dense, paired, points (95 % interval) on "
             f"{' / '.join(r['task'] for r in first['paired_distilled_minus_dense'])} (500 items): 307,200 tokens "
             f"(fp32, the study): **{first['val_gap']:+.3f}**, {pairs(first['paired_distilled_minus_dense'])}"]
    for r in runs:
        tokens, dtype = r["summaries"]["dense"]["tokens_seen"], "bf16" if "bfloat16" in r["what"] else "fp32"
        parts.append(f"{tokens:,} tokens ({dtype}): **{r['val_gap'][-1][1]:+.3f}**, {pairs(r['paired_distilled_minus_dense'])}")
        if r.get("kd_from_continued"):  # the arm taught by dense continued itself (midtrain_longer --kd-from-continued)
            kdc = r["kd_from_continued"]
            parts.append(f"the same, taught by dense continued (constant KL): **{kdc['val_gap'][-1][1]:+.3f}**, "
                         f"{pairs(kdc['paired_minus_dense'])}")
    below = sorted({p["task"] for r in runs for p in r["paired_distilled_minus_dense"] + r["at_307k"]["paired_distilled_minus_dense"]
                    + (r.get("kd_from_continued") or {}).get("paired_minus_dense", [])
                    if p["high"] < -ZERO_SHOT_POINTS_GOAL / 100})
    measured = "; ".join(parts) + " ([docs](docs/insertion.md#distillation-during-mid-training-rundistill))"
    return measured, (f"300k tokens: {yes(first['val_gap'] <= CPU_MIDTRAIN_GAP_GOAL)} (one seed); zero-shot: "
                      f"{'**no** (' + ', '.join(below) + ' below by more than a point)' if below else 'inconclusive'}")


GPU_STEP_GOALS = {"350m": {"stem-full": 0.93, "stem-1/3": 0.97}, "1b": {"stem-full": 0.88, "stem-1/3": 0.95}}  # issue 33
GPU_LEASE = RES + "gpu_h200_2026-11-27/"  # first lease: eager, compiled, grad-accum 8, decode
GPU_LEASE3 = RES + "gpu_h200_2026-11-28/"  # third lease: captured step at 350M and 1B, GEMM epilogues, grad-accum 8


@row("GPU training step, 16×512 tokens, captured: STEM-full ÷ dense ≤ 0.93 (350M) / 0.88 (1B), STEM-1/3 ≤ 0.97 / "
     "0.95; grad-accum 8 ≤ 0.90; decode batch 1 ≥ 250 tok/s", "gpu_suite.py", GPU_LEASE3 + "suite_g.json",
     GPU_LEASE3 + "suite_c.json", GPU_LEASE + "call3.json", GPU_LEASE3 + "gpu_checks.json")
def gpu_suite(new: dict, more: dict, first: dict, checks: dict) -> tuple[str, str]:
    r = new["results"]
    graphs = {"350m": r["graph"]["compiled"], "1b": r["graph_1b"]["compiled"]}
    ratio = {shape: {a: g["ratio_to_dense"][a] for a in GPU_STEP_GOALS[shape]} for shape, g in graphs.items()}  # medians
    compiled = first["results"]["train"]["350m"]["compiled"]
    accum = more["results"]["accum"]["graph"]["ratio_to_dense"]["stem-full"]
    d = more["results"]["decode"]
    same = checks["graph"]["stem-full"]["max_abs_loss_diff"] == 0 and checks["graph"]["dense"]["max_abs_loss_diff"] == 0
    whole = checks["graph"].get("stem-1/3-dense-optimizer", {}).get("max_abs_loss_diff")
    shapes = "; ".join(f"{shape.upper()} STEM-full **{ratio[shape]['stem-full']:.3f}×**, STEM-1/3 "
                       f"**{ratio[shape]['stem-1/3']:.3f}×** dense ({ms(graphs[shape]['step_s']['dense'])})"
                       for shape in graphs)
    measured = (f"{new['device']}, whole step captured (`run.step_graph=auto`, default on CUDA), tuned table kernels: "
                f"{shapes}; compiled blocks alone (first lease) STEM-full {compiled['ratio_to_dense']['stem-full']:.2f}×; "
                f"table path {r['profile']['table_path_ms_per_micro_batch']:.1f} ms GPU per micro-batch "
                f"(table work in the GEMMs' epilogues: {r['profile']['table_path_gemm_ms_per_micro_batch']:.1f} ms); "
                f"grad-accum 8 captured **{accum:.3f}×**; captured losses (dense, STEM-full) "
                f"{'bit-identical to' if same else 'differ from'} eager"
                f"{'' if not whole else f', tables in the dense optimizer {whole:.1e} apart (fp32 atomics; fixed-order sums since, not yet re-measured)'}; decode batch 1 {d['device_b1_tok_s']:.0f} tok/s "
                f"([docs](docs/gpu.md#measured-on-one-h200-2026-11-28-third-lease-the-gemm-epilogues-grad-accum-8-captured))")
    met = {shape: all(ratio[shape][a] <= goal for a, goal in GPU_STEP_GOALS[shape].items()) for shape in graphs}
    full_1b = ratio["1b"]["stem-full"] <= GPU_STEP_GOALS["1b"]["stem-full"]
    return measured, (f"step ratios: {yes(met['350m'] and met['1b'])} (1B STEM-full: {yes(full_1b)}); "
                      f"grad-accum 8: {yes(accum <= 0.90)}; decode: {yes(d['device_b1_tok_s'] >= 250)}")


REAL_FLIP_GOAL = 0.8


@row(f"real-model edit (SmolLM2-135M, calibrated rows): ≥ {pct(REAL_FLIP_GOAL, 0)} of known capitals flip on held-out "
     f"phrasings, ≥ {pct(LOCALITY_GOAL, 0)} locality, exact undo", "bench_edit_real.py", RES + "edit_real.json",
     RES + "edit_real.layer0*.json")
def edit_real(r: dict, layer0s: dict) -> tuple[str, str]:
    held = r["placements"]["heldout_template"]
    named = {k: v for k, v in held.items() if not k.isdigit()}

    def flips(v: dict) -> str:
        return f"{pct(v['success'])} of {v['known']}" if v["success"] is not None else f"none of {v['known']}"

    cells = ", ".join(f"STEM at {k}: knows {v['known_facts']}/{v['probes']}, flips {flips(v)}" for k, v in named.items())
    mid = [(m["heldout_template"], m["train"]) for m in r.get("midtrained", [])]
    mid_cell = "".join(f"; mid-trained STEM-1/3: knows {h['known_facts']}/{h['probes']}, flips {flips(h)} "
                       f"(training phrasing {flips(t)}), locality {pct(h['locality_top1'])}" for h, t in mid)
    extra = []
    for layer0 in layer0s.values():  # tables at layer 0 (--tag layer0*): each conversion / strategy its own cells
        how = ", ".join(edit_settings(layer0))
        for k, v in layer0["placements"]["heldout_template"].items():
            if not k.isdigit() and k != "1/3":
                extra.append(v)
                cells += (f", STEM at {k}{f' ({how})' if how else ''}: knows {v['known_facts']}/{v['probes']}, "
                          f"flips {flips(v)}, locality {pct(v['locality_top1'])}"
                          + (f" ({pct(v['locality_known'])} of known)" if v.get("locality_known") is not None else ""))
    runs = list(named.values()) + [h for h, _ in mid] + extra
    undo = all(v["reversible"] in (1, None) for v in runs)
    ok = any((v["success"] or 0) >= REAL_FLIP_GOAL and v["locality_top1"] >= LOCALITY_GOAL for v in runs) and undo
    dense = r["dense_known"]["heldout_template"]
    return (f"{r['pairs']} country pairs, held-out phrasings, dense knows {dense['first']}/{dense['asked']}: {cells}"
            f"{mid_cell}; undo {'exact' if undo else 'not exact'} "
            "([docs](docs/insertion.md#editing-a-real-models-facts-by-rows-smollm2-135m))"), yes(ok)


BATCH_GOAL = 4


@row(f"batched decode: batch 8 ≥ {BATCH_GOAL}× the tokens/s of batch 1", "bench_batch_decode.py",
     RES + "batch_decode.json")
def batch_decode(r: dict) -> tuple[str, str]:
    cfg, tiers = r["config"], {t: v for t, v in r["tiers"].items() if v["summary"]}
    parts = []
    for tier, res in tiers.items():
        b1, b8 = res["batches"]["1"], res["batches"]["8"]
        parts.append(f"{tier}: **{res['summary']['speed_ratio_b8_over_b1']:.2f}×** ({b1['decode_tokens_per_s']:.0f} → "
                     f"{b8['decode_tokens_per_s']:.0f} tok/s; rows per step {b8['rows_per_step']:.1f} against "
                     f"{b8['request_rows_per_step']:.1f} fetched one request at a time)")
    measured = (f"{cfg['preset']}, STEM-{cfg['stem_layers']}, median of per-round ratios over {cfg['repeats']} "
                f"rounds: " + "; ".join(parts) + " ([docs](docs/generation.md#batched-generation))")
    return measured, "; ".join(f"{t}: {yes(v['summary']['speed_ratio_b8_over_b1'] >= BATCH_GOAL)}"
                               for t, v in tiers.items())


SERVE_GOAL = 0.10


@row(f"`stemlm serve`: throughput within {pct(SERVE_GOAL, 0)} of direct batched generation at 1–16 concurrent "
     "clients, no request lost", "bench_serve.py", RES + "bench_serve.json")
def serve(r: dict) -> tuple[str, str]:
    cfg, levels = r["config"], r["concurrency"]
    cells = ", ".join(f"C={c} **{100 * v['overhead']:+.0f} %**" for c, v in levels.items())
    split = ", ".join(f"C={c} {100 * v['overhead_of_continuous_batching']:+.0f} / {100 * v['overhead_of_http']:+.0f} %"
                      for c, v in levels.items())
    top = levels[max(levels, key=int)]
    lost = sum(v["requests_lost"] for v in levels.values())
    client = cfg["clients"].split()[0]  # raw (http.client) or openai
    lengths = "one prompt length per direct batch" if cfg.get("aligned_lengths", True) else "prompt lengths mixed in every batch"
    measured = (f"{cfg['preset']} STEM-{cfg['stem_layers']}, {cfg['tier']} tables, C closed-loop {client} clients × "
                f"{cfg['requests_per_client']} requests × {cfg['max_tokens']} tokens, {lengths}, median of {cfg['repeats']} paired "
                f"rounds: overhead {cells}; of which continuous batching / HTTP: {split}; at C={max(levels, key=int)} "
                f"{top['served']['tokens_per_s']:.0f} tok/s, latency p50 {top['served']['latency_p50_s']:.2f} s, p95 "
                f"{top['served']['latency_p95_s']:.2f} s; requests lost {lost} "
                "([docs](docs/serving.md#load-benchmark))")
    ok = [c for c, v in levels.items() if v["overhead"] <= SERVE_GOAL]
    met = "yes" if len(ok) == len(levels) and not lost else (f"at C={', '.join(ok)} yes; elsewhere no" if ok else "no")
    return measured, met


SOAK_RSS_GROWTH = 0.02  # of the start RSS, allowed from half time to the end


@row("`stemlm serve` soak: concurrent clients with bad, oversized, unauthorized and abandoned requests: no request "
     "lost, no slot left, memory flat", "soak_serve.py", RES + "soak_serve.json")
def soak(r: dict) -> tuple[str, str]:
    cfg, rss, a = r["config"], r["rss_mb"], r["answers"]
    done = sum(n for k, n in a.items() if k.endswith(" 200"))
    errors = ", ".join(f"{n:,} × {status}" for status, n in r["errors_by_kind"].items())
    measured = (f"{cfg['clients']} clients, {r['requests']:,} requests in {r['seconds']:.0f} s: **lost {r['lost']}**, "
                f"slots left {r['slots_left']}, admitted but unfinished {r['admitted_not_finished']}; {done:,} answered "
                f"200, {errors}, {a.get('abandoned None', 0):,} abandoned "
                f"({r['server_metrics']['requests_cancelled']:,} cancelled in the engine); p95 "
                f"{r['latency_ok_p95_s']:.2f} s; RSS {rss['start']:.0f} → {rss['half']:.0f} (half time) → {rss['end']:.0f} MiB "
                "([docs](docs/serving.md#soak-test))")
    flat = rss["end"] - rss["half"] <= SOAK_RSS_GROWTH * rss["start"]
    return measured, yes(r["lost"] == 0 and r["slots_left"] == 0 and r["admitted_not_finished"] == 0 and flat)


QUANT_GOAL = 0.5  # % perplexity
QUANT_INT8_BYTES = 3.9  # "÷4": d_ff + 4 bytes a row (one scale per row) reached 3.98-3.99


@row(f"quantized tables: int8 validation perplexity within +{QUANT_GOAL} % of fp32, table bytes ÷2 (bf16) / ÷4 (int8); "
     "decode with int8 tables on disk vs fp32 in RAM", "bench_quant_tables.py", RES + "quant_tables.json")
def quant_tables(r: dict) -> tuple[str, str]:
    parts, verdicts = [], []
    for name, m in r["models"].items():
        by = m["by_dtype"]
        parts.append(f"{name}: " + ", ".join(f"{k} {by[k]['ppl_change_pct']:+.2f} % (÷{by[k]['bytes_ratio_vs_fp32']:.2f})"
                                            for k in by if k != "fp32"))
        int8 = by["int8"]
        verdicts.append(f"{name}: perplexity {yes(int8['ppl_change_pct'] <= QUANT_GOAL)}, bytes ÷4 "
                        f"{yes(int8['bytes_ratio_vs_fp32'] >= QUANT_INT8_BYTES)} (÷{int8['bytes_ratio_vs_fp32']:.2f})")
    measured = "perplexity vs fp32 (table bytes ÷): " + "; ".join(parts)
    if (d := r.get("decode")):
        measured += (f"; decode int8 on disk ÷ fp32 in RAM **{d['ratio_disk_int8_vs_ram_fp32']:.2f}×** (median of "
                     f"{d['repeats']} paired rounds, {span(d['round_ratios'])})")
    return measured + " ([docs](docs/quantization.md#measurements))", "; ".join(verdicts)


WIDE_TOKENS_GOAL, WIDE_SECONDS_GOAL = 20_000_000, 600


@row(f"wide corpus (`stemlm data prepare --corpus wide`): ≥ {WIDE_TOKENS_GOAL / 1e6:.0f}M train tokens at vocabulary "
     f"4096 from registry packages, built in ≤ {WIDE_SECONDS_GOAL // 60} min on 2 cores", "bench_wide_corpus.py",
     RES + "wide_corpus.json")
def wide_corpus(r: dict) -> tuple[str, str]:
    src = r["sources"]
    parts = ", ".join(f"{name} {v['train_tokens'] / 1e6:.1f}M" for name, v in sorted(src.items(), key=lambda kv: -kv[1].get(
        "train_tokens", 0)))
    measured = (f"**{r['n_tokens']['train']:,} train** / {r['n_tokens']['val']:,} val tokens at V {r['vocab_size']} "
                f"({parts}); built in **{r['build_seconds']:.0f} s** on {r['cores']} shared cores, peak RSS "
                f"{r['peak_rss_mib']:.0f} MiB; {r['duplicates_removed']} duplicate chunks removed; not to be scored on "
                f"{', '.join(r['excluded_benchmarks'])} ([docs](docs/data.md#the-wide-corpus-wide-v1))")
    ok = r["n_tokens"]["train"] >= WIDE_TOKENS_GOAL and r["build_seconds"] <= WIDE_SECONDS_GOAL and r["cores"] <= 2
    return measured, yes(ok)


def main(argv: list[str] | None = None) -> int:
    """Rewrite README.md's results table (or with ``--check`` only say whether it is current)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="exit 1 if the table is out of date; write nothing")
    ap.add_argument("--readme", type=Path, default=ROOT / "README.md", help="the file holding the table "
                                                                          "(default: README.md of this checkout)")
    args = ap.parse_args(argv)
    table, notes = render()
    for note in notes:
        print(note, file=sys.stderr)
    old = args.readme.read_text()
    try:
        new = replace_table(old, table)
        if (claims := render_claims()) is not None:
            new = replace_table(new, claims, CLAIMS_BEGIN, CLAIMS_END)
    except ValueError as e:
        print(f"error: {args.readme}: {e}", file=sys.stderr)
        return 2
    if args.check:
        if new != old:
            print(f"{args.readme}: the results table is out of date; run python benchmarks/readme_table.py",
                  file=sys.stderr)
            return 1
        print(f"{args.readme}: the results table is current")
        return 0
    if new != old:
        from stemlm.runtime.files import atomic_write_text

        atomic_write_text(args.readme, new)
    print(f"{'wrote' if new != old else 'unchanged:'} {args.readme}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
