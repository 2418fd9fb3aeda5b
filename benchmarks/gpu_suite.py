"""Every GPU figure of issues 27 and 33 side by side in one run, with its goal: met / not met / unmeasured.

    python benchmarks/gpu_suite.py              # on one H100/H200 (make gpu-check); budget ≤ 6 min with compilation
    python benchmarks/gpu_suite.py --dry-run    # the whole suite on the CPU at tiny shapes, in seconds (CI)
    python benchmarks/gpu_suite.py --sections train,profile --shapes 350m   # a subset

Sections (each trains the real loop, ``Trainer.train_step``, on the prepared corpus in
``$STEMLM_CACHE/data/default-v1`` when there, else on Zipf-distributed random tokens; bf16
autocast, 16 × 512 tokens per step, vocabulary 4096; the table path and kernels are the
defaults: fused, Triton on CUDA):

* ``train``: dense, STEM-1/3 and STEM-full at the ``mobilellm-350m`` and ``llama3.2-1b`` shapes,
  eager and with compiled blocks, steps interleaved; each STEM ÷ dense time ratio (median of
  per-round ratios) next to its FLOP ratio and its roofline ratio (FLOPs at the measured GEMM rate
  plus optimizer and table bytes at the measured memory bandwidth, ``stemlm.accounting``);
* ``graph``: the three arms at each shape (results ``graph``: 350M, ``graph_1b``: 1B) with the whole
  step captured as one CUDA graph (``run.step_graph=graph``) over compiled blocks; a section that
  fails is reported with its error;
* ``gemm``: the same captured steps with the STEM arms' table work in the GEMMs' epilogues
  (``run.table_kernels=triton-gemm``: the gather inside the gate's GEMM, the row gradient inside the down
  projection's backward GEMM; results ``gemm`` / ``gemm_1b``), dense re-measured beside them;
* ``accum``: dense and STEM-full with ``optim.grad_accum=8`` (65k tokens per step);
* ``hf``: stemlm dense ÷ HF ``LlamaForCausalLM`` (sdpa) at the 350M shape, if transformers imports;
* ``host`` / ``host49k``: STEM-full with its tables and optimizer state in host RAM
  (``run.tables=host``) ÷ on the GPU, and the GPU memory each holds, at vocabulary 4096 and 49,152;
* ``decode``: STEM-1/3 tokens/s at batch 1 and 16, tables on the GPU and in host RAM;
* ``profile``: a profiler of dense and STEM-full steps: GPU kernel time, GEMM time, GPU busy ÷
  step wall time, and the GPU time the table path adds per micro-batch (with ``triton-gemm`` too, where the
  table work runs inside GEMM kernels: STEM-full's kernel time beyond dense's plus the GEMM time it saves);
* ``cli``: the tokens/s and MFU (against the card's bf16 peak) that ``stemlm train`` logs with its
  default settings (``run.compile=auto``);
* ``ngram``: issue 36's cost: n-gram rows (token + hashed bigram/trigram keys) ÷ STEM's token rows at
  placements 1/3 and full, captured, at the 350M shape (goal ≤ 1.10).

Only torch, numpy, safetensors, tokenizers and pyyaml (and triton, which comes with torch on a GPU
machine) need to be importable. Writes ``benchmarks/results/gpu_suite.json`` (``gpu_suite.quick.json``
for a dry run) with the device name, torch and CUDA versions and the commit. See docs/gpu.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from pathlib import Path

import torch
from _gpu_parts import (accum_section, cli_section, copy_bandwidth, decode_section, error_text, free, gemm_section,
                        graph_section, hf_section, host_section, matmul_peak, ngram_section, profile_section, spec_peak,
                        train_section)
from _train_bench import synthetic_data_dir, write_result
from stemlm.kernels import configs as kernel_configs  # the tile sizes the table kernels run ($STEMLM_TABLE_KERNEL_CONFIGS)

SHAPES = {"350m": "mobilellm-350m", "1b": "llama3.2-1b"}
SECTIONS = ("train", "graph", "gemm", "accum", "hf", "host", "host49k", "decode", "profile", "cli", "ngram")
HOST_VOCAB = 49152  # SmolLM2's vocabulary: tables that do not fit beside the model on a smaller card


def settings(dry_run: bool, args) -> dict:
    """What the suite runs: full size on CUDA, tiny on the CPU for ``--dry-run``."""
    if dry_run:
        s = {"device": "cpu", "dtype": "float32", "batch": 2, "seq": 32, "vocab": 512, "steps": 2, "warmup": 1,
             "compile": args.compile_in_dry_run, "decode_tokens": 3, "accum": 2, "presets": {k: "debug" for k in SHAPES},
             "data": [f"data.dir={synthetic_data_dir(512, n_tokens=20_000)}"], "host_vocab": 1024}
    else:
        if not torch.cuda.is_available():
            raise SystemExit("gpu_suite: no CUDA device; use --dry-run for the CPU smoke run")
        s = {"device": "cuda", "dtype": "bfloat16", "batch": 16, "seq": 512, "vocab": 4096, "steps": args.steps,
             "warmup": 3, "compile": True, "decode_tokens": 100, "accum": 8, "presets": dict(SHAPES), "data": [corpus_override()]}
    s["presets"] = {k: v for k, v in s["presets"].items() if k in args.shapes}
    return s


def corpus_override() -> str:
    """``data.dir=`` the prepared default corpus under ``$STEMLM_CACHE``, else random Zipf tokens."""
    root = Path(os.environ.get("STEMLM_CACHE", Path.home() / ".cache" / "stemlm")) / "data" / "default-v1"
    return f"data.dir={root if (root / 'meta.json').exists() else synthetic_data_dir(4096)}"


def run_suite(s: dict, sections: tuple[str, ...], profile: bool, after_section=None) -> dict:
    """Every selected section, in order; a section that fails is recorded with its error.
    ``after_section(results_so_far)`` runs after each section (the suite saves partial results with it,
    so a run stopped at a device time limit keeps what it measured)."""
    out: dict = {"train": {}, "profile": None}
    cuda = s["device"] == "cuda"
    peak_dtype = torch.bfloat16 if cuda else torch.float32
    s["rates"] = out["rates"] = {"gemm": matmul_peak(s["device"], peak_dtype, 8192 if cuda else 256),
                                 "bandwidth": copy_bandwidth(s["device"], 2**30 if cuda else 2**24)}
    out["matmul_peak"] = s["rates"]["gemm"]
    big = {"host49k": lambda s_, p: host_section(s_, p, vocab=s_.get("host_vocab", HOST_VOCAB),
                                                 cache_rows=s_.get("host_vocab", HOST_VOCAB) // 3),
           "cli": lambda s_, p: cli_section(s_, p, s_["steps"])}
    steps = ([("train", k, train_section) for k in s["presets"]] + [("graph", k, graph_section) for k in s["presets"]]
             + [("gemm", k, gemm_section) for k in s["presets"]]
             + [("accum", "350m", accum_section), ("hf", "350m", hf_section), ("host", "350m", host_section),
                ("host49k", "350m", big["host49k"]), ("decode", "350m", decode_section),
                ("profile", "350m", profile_section), ("cli", "350m", big["cli"]), ("ngram", "350m", ngram_section)])
    if profile and "profile" not in sections:
        sections = (*sections, "profile")
    for section, shape, fn in steps:
        if section not in sections or shape not in s["presets"]:
            continue
        t0 = time.perf_counter()
        try:
            result = fn(s, s["presets"][shape])
        except torch.cuda.OutOfMemoryError as e:
            result = {"error": f"out of memory: {str(e).splitlines()[0]}"}
            free(s)
        except Exception as e:  # a section that breaks is reported, the others still run
            result = {"error": error_text(e)}
            print(f"  {section} {shape} failed: {result['error']}", flush=True)
            free(s)
        if isinstance(result, dict):
            result["section_s"] = time.perf_counter() - t0
            if "dense_model" in result:
                result["dense_model"] = result["dense_model"].to_dict()
        print(f"  {section} {shape}: {time.perf_counter() - t0:.0f} s", flush=True)
        if section == "train":
            out["train"][shape] = result
        elif section in ("accum", "graph", "gemm") and isinstance(result, dict) and "dense_model" in result:
            out[section if section == "accum" else graph_key(shape, section)] = {k: v for k, v in result.items()
                                                                                 if k != "dense_model"}
        else:
            out[section] = result
        if after_section is not None:
            after_section(out)
    return out


# issue 33's step-ratio goals (16 × 512 tokens, each arm in its fastest mode): shape -> arm -> ratio to dense
STEP_GOALS = {"350m": {"stem-full": 0.93, "stem-1/3": 0.97}, "1b": {"stem-full": 0.88, "stem-1/3": 0.95}}


def graph_key(shape: str, section: str = "graph") -> str:
    """Where the ``graph`` (or ``gemm``) section of ``shape`` is kept: ``graph`` for the 350M shape,
    ``graph_<shape>`` else."""
    return section if shape == "350m" else f"{section}_{shape}"


def mode_steps(t: dict, g: dict | None, gm: dict | None = None) -> dict[str, dict[str, float]]:
    """``mode -> arm -> median step s`` of one shape: its ``train`` modes, plus ``graph`` (the
    captured step over compiled blocks) where the graph section measured it and ``graph-gemm`` (the same
    with the table work in the GEMMs' epilogues) where the gemm section did."""
    modes = {m: t[m]["step_s"] for m in ("eager", "compiled") if m in t}
    for name, section in (("graph", g), ("graph-gemm", gm)):
        if section and "error" not in section and section.get("compiled"):
            modes[name] = section["compiled"]["step_s"]
    return modes


def fastest(modes: dict[str, dict[str, float]], arm: str) -> tuple[str | None, float | None]:
    """``(mode, ratio)``: ``arm``'s fastest step over the modes ÷ dense's fastest step over the modes
    (each in its own fastest mode, like for like: a captured STEM step is compared with a captured
    dense step when that is dense's fastest)."""
    if not modes:
        return None, None
    mode = min(modes, key=lambda m: modes[m][arm])
    return mode, modes[mode][arm] / min(m["dense"] for m in modes.values())


def goals(r: dict, s: dict, dry_run: bool, device_name: str) -> list[dict]:
    """The issue's goals with the measured value and met / not met / unmeasured."""
    rows = []

    def add(goal, value, ok):
        status = "unmeasured" if value is None or dry_run else ("met" if ok else "not met")
        rows.append({"goal": goal, "measured": value, "status": status + (" (dry run)" if dry_run else "")})

    g = r.get("graph") or {}
    for shape in [k for k in SHAPES if k in r["train"] or r.get(graph_key(k)) or r.get(graph_key(k, "gemm"))]:
        t = r["train"].get(shape, {})  # a run of the graph or gemm section alone counts too
        gs = r.get(graph_key(shape)) or r.get(graph_key(shape, "gemm")) or {}
        if "error" in t:
            t = {}
        modes = mode_steps(t, r.get(graph_key(shape)), r.get(graph_key(shape, "gemm")))
        if not modes:
            continue
        for arm, goal in STEP_GOALS.get(shape, {}).items():
            mode, ratio = fastest(modes, arm)
            roof = (t.get("roofline_ratio") or gs.get("roofline_ratio", {})).get(arm, float("nan"))
            flop = (t.get("compiled") or t.get("eager") or gs.get("compiled") or {}).get("flop_ratio", {}).get(arm, float("nan"))
            add(f"{shape}: {arm} ÷ dense step ≤ {goal} (fastest modes)",
                None if ratio is None else f"{ratio:.3f} ({mode}; roofline {roof:.3f}, FLOPs {flop:.3f})",
                ratio is not None and ratio <= goal)
            add(f"{shape}: {arm} ratio within +0.03 of its roofline ratio",
                None if ratio is None else f"{ratio:.3f} vs {roof:.3f}", ratio is not None and ratio <= roof + 0.03)
    a = r.get("accum") or {}
    if a and "error" not in a:
        modes = {m: a[m]["step_s"] for m in ("eager", "compiled", "graph", "graph-gemm") if m in a and "error" not in a[m]}
        mode, ratio = fastest(modes, "stem-full")
        add("350m grad_accum=8: stem-full ÷ dense ≤ 0.90", f"{ratio:.3f} ({mode}; roofline "
            f"{a['roofline_ratio']['stem-full']:.3f})", ratio <= 0.90)
    else:
        add("350m grad_accum=8: stem-full ÷ dense ≤ 0.90", None, False)
    p = r.get("profile") or {}
    tp = p.get("table_path_ms_per_micro_batch")
    tpg = p.get("table_path_gemm_ms_per_micro_batch")
    best_tp = min((v for v in (tp, tpg) if v is not None), default=None)
    add("350m stem-full: table path adds ≤ 2 ms GPU time per micro-batch (profiler)",
        None if best_tp is None else f"{best_tp:.2f} ms" + ("" if tpg is None else f" (triton {tp:.2f}, triton-gemm {tpg:.2f})"),
        best_tp is not None and best_tp <= 2.0)
    busy = {m: (p.get(k) or {}).get("busy_fraction") for m, k in (("compiled", "dense"), ("graph", "graph-dense"))}
    best = max((m for m in busy if busy[m] is not None), key=lambda m: busy[m], default=None)
    add("350m dense: GPU busy ≥ 90 % of the step", None if best is None else f"{100 * busy[best]:.0f} % ({best})",
        best is not None and busy[best] >= 0.9)
    t = r["train"].get("350m", {})
    peak = spec_peak(device_name) or r["matmul_peak"]
    t = {} if "error" in t else t
    dense_modes = mode_steps(t, g)
    dense_step = min((m["dense"] for m in dense_modes.values()), default=None)
    src = t if "flops_per_token" in t else g  # the graph section alone carries the same FLOPs and tokens
    mfu = None if dense_step is None else src["flops_per_token"]["dense"] * src["tokens_per_step"] / dense_step / peak
    add("350m: dense MFU ≥ 40 % of the bf16 peak (fastest mode)", None if mfu is None else f"{100 * mfu:.1f} %",
        (mfu or 0) >= 0.40)
    c = r.get("cli") or {}
    add("350m: `stemlm train` logs MFU against the bf16 peak (default settings)",
        None if "mfu" not in c else f"{100 * c['mfu']:.1f} % at {c['tokens_per_s']:.0f} tok/s ({c['peak_source']})",
        "mfu" in c and c["mfu"] < 1)
    hf = r.get("hf")
    add("350m: stemlm dense ≥ 1.5× HF Llama", None if not hf or "error" in hf else f"{hf['hf_over_stemlm']:.2f}×",
        bool(hf) and hf.get("hf_over_stemlm", 0) >= 1.5)
    for key in ("host", "host49k"):
        h = r.get(key) or {}
        both = {k: h[k] for k in ("host_over_device", "slab_over_device") if h.get(k) is not None}
        ratio = min(both.values(), default=None)  # the faster host arm: the window, or the slab captured
        vocab = h.get("vocab", HOST_VOCAB if key == "host49k" else s["vocab"])
        text = None if ratio is None else f"{1 / ratio:.3f}×" + ("" if len(both) < 2 else (
            f" (window {1 / both['host_over_device']:.3f}×, slab captured {1 / both['slab_over_device']:.3f}×)"))
        add(f"host-RAM tables (V={vocab}): step ≥ 0.9× all-on-GPU", text, ratio is not None and 1 / ratio >= 0.9)
        for arm, label in (("host", ""), ("slab", ", slab")):
            held = h.get(f"{arm}_between_steps_bytes")
            if arm == "slab" and held is None:
                continue
            add(f"host-RAM tables (V={vocab}{label}): GPU memory ≤ backbone + its optimizer + cache + rows of two steps",
                None if held is None else f"{held / 1e9:.2f} GB vs {h['bound_bytes'] / 1e9:.2f} GB",
                held is not None and held <= h["bound_bytes"])
    ng = (r.get("ngram") or {}).get("ngram_over_stem")
    add("350m: n-gram rows ÷ STEM rows, step at the same placement ≤ 1.10 (captured; issue 36)",
        None if not ng else ", ".join(f"{p} {v:.3f}×" for p, v in ng.items()), bool(ng) and max(ng.values()) <= 1.10)
    d = r.get("decode") or {}
    b1, b16, host1, host16 = (d.get(k) for k in ("device_b1_tok_s", "device_b16_tok_s", "host_b1_tok_s", "host_b16_tok_s"))
    eager = d.get("device_b1_eager_tok_s")
    add("decode batch 1 (350m) ≥ 250 tok/s and ≥ 5× the eager decode",
        None if b1 is None else f"{b1:.0f} tok/s ({d.get('device_b1_mode')}), {b1 / eager:.1f}× eager {eager:.0f}",
        (b1 or 0) >= 250 and bool(eager) and b1 / eager >= 5)
    same = all(v for k, v in d.items() if k.endswith("_same_tokens"))
    add("decode: every setting gives the eager device run's tokens", None if not d else str(same), same)
    add("decode host tables ≥ 0.95× device tables, batch 1", None if not (b1 and host1) else f"{host1 / b1:.2f}×",
        bool(b1 and host1) and host1 / b1 >= 0.95)
    add("decode host tables ≥ 0.95× device tables, batch 16", None if not (b16 and host16) else f"{host16 / b16:.2f}×",
        bool(b16 and host16) and host16 / b16 >= 0.95)
    add("decode batch 16 ≥ 8× batch 1", None if not (b1 and b16) else f"{b16 / b1:.1f}×", bool(b1 and b16) and b16 / b1 >= 8)
    gd = (g.get("compiled") or g.get("eager") or {}) if "error" not in g else {}
    add("350m: the whole step captured as one CUDA graph (run.step_graph=graph) runs, dense step time",
        g["error"] if "error" in g else (None if not gd else f"{1e3 * gd['step_s']['dense']:.1f} ms"),
        bool(gd) and "error" not in g)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, seconds; goals stay unmeasured")
    ap.add_argument("--compile-in-dry-run", action="store_true", help="also compile the blocks in a dry run (slow on CPU)")
    ap.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {','.join(SECTIONS)}")
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated subset of {','.join(SHAPES)}")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per arm (default 10)")
    ap.add_argument("--profile", action="store_true", help="add the profile section (it is in the default sections)")
    args = ap.parse_args()
    if args.dry_run:  # the gemm section's Triton kernels run interpreted; set before anything imports triton
        os.environ.setdefault("TRITON_INTERPRET", "1")
    args.shapes = tuple(x for x in args.shapes.split(",") if x)
    sections = tuple(x for x in args.sections.split(",") if x)
    bad = [x for x in (*sections, *args.shapes) if x not in (*SECTIONS, *SHAPES)]
    if bad:
        ap.error(f"unknown section or shape {bad[0]!r}")
    t0 = time.perf_counter()
    s = settings(args.dry_run, args)
    device_name = torch.cuda.get_device_name() if s["device"] == "cuda" else f"cpu ({platform.processor() or platform.machine()})"
    print(f"gpu_suite on {device_name}, torch {torch.__version__}, CUDA {torch.version.cuda}", flush=True)

    def payload(r: dict, partial: bool) -> dict:
        return {"device": device_name, "torch": torch.__version__, "cuda": torch.version.cuda, "dry_run": args.dry_run,
                "partial": partial, "sections": list(sections), "settings": {k: v for k, v in s.items() if k != "data"},
                "table_kernel_configs": kernel_configs.ACTIVE,
                "data": s["data"][0], "results": r, "goals": goals(r, s, args.dry_run, device_name),
                "wall_s": time.perf_counter() - t0}

    r = run_suite(s, sections, args.profile, after_section=lambda r_: write_result("gpu_suite", args.dry_run, payload(r_, True)))
    final = payload(r, False)
    print(format_report(r, final["goals"]))
    print(f"wrote {write_result('gpu_suite', args.dry_run, final)} ({final['wall_s']:.0f} s)")


def format_report(r: dict, rows: list[dict]) -> str:
    """The measured figures and the goals table, as text."""
    lines = []
    for shape, t in r["train"].items():
        for mode in ("eager", "compiled"):
            if mode in t:
                m = t[mode]
                steps = "  ".join(f"{a} {1e3 * v:.1f} ms" for a, v in m["step_s"].items())
                ratios = "  ".join(f"{a} {m['ratio_to_dense'][a]:.3f} (FLOPs {m['flop_ratio'][a]:.3f})" for a in m["ratio_to_dense"])
                lines.append(f"train {shape} {mode}: {steps} | ÷ dense: {ratios}")
        lines.append(f"train {shape} roofline ÷ dense: " + "  ".join(f"{a} {v:.3f}" for a, v in t.get("roofline_ratio", {}).items()))
    lines.append(f"rates: GEMM {r['rates']['gemm'] / 1e12:.1f} TFLOP/s, memory {r['rates']['bandwidth'] / 1e9:.0f} GB/s")
    for name in ("graph", "graph_1b", "accum", "hf", "host", "host49k", "decode", "cli"):
        if r.get(name):
            lines.append(f"{name}: " + ", ".join(f"{k}={_fmt(v)}" for k, v in r[name].items() if k != "preset"))
    p = r.get("profile") or {}
    for arm in ("dense", "stem-full", "graph-dense", "graph-stem-full"):
        if arm in p and "error" in p[arm]:
            lines.append(f"profile {arm}: {p[arm]['error']}")
        elif arm in p:
            q = p[arm]
            lines.append(f"profile {arm}: kernels {q['kernel_ms_per_step']:.1f} ms/step (GEMM {q['gemm_ms_per_step']:.1f}), "
                         f"wall {q['wall_ms_per_step']:.1f} ms, busy {100 * q['busy_fraction']:.0f} %")
            lines.append(q["table"])
    if "table_path_ms_per_micro_batch" in p:
        lines.append(f"profile: the table path adds {p['table_path_ms_per_micro_batch']:.2f} ms of kernels per micro-batch")
    width = max(len(g["goal"]) for g in rows)
    lines += ["", f"{'goal':<{width}}  {'measured':<28} status"]
    lines += [f"{g['goal']:<{width}}  {str(g['measured'] or '-'):<28} {g['status']}" for g in rows]
    return "\n".join(lines)


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {_fmt(x)}" for k, x in v.items()) + "}"
    return str(v)


if __name__ == "__main__":
    main()
