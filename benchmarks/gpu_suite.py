"""Every GPU figure of issue 27 side by side in one run, with its goal: met / not met / unmeasured.

    python benchmarks/gpu_suite.py              # on one H100/H200 (make gpu-check); ~6 min with compilation
    python benchmarks/gpu_suite.py --dry-run    # the whole suite on the CPU at tiny shapes, in seconds (CI)
    python benchmarks/gpu_suite.py --sections train --shapes 350m --profile   # a subset, plus a profiler table

Sections (each trains the real loop, ``Trainer.train_step``, on the prepared corpus in
``$STEMLM_CACHE/data/default-v1`` when there, else on Zipf-distributed random tokens; bf16
autocast, 16 × 512 tokens per step, vocabulary 4096):

* ``train``: dense, STEM-1/3 and STEM-full at the ``mobilellm-350m`` and ``llama3.2-1b`` shapes,
  eager and with compiled blocks, steps interleaved; each STEM ÷ dense time ratio (median of
  per-round ratios) next to its FLOP ratio (``stemlm.accounting``); dense MFU against the bf16
  peak (spec sheet, and a measured matmul);
* ``hf``: stemlm dense ÷ HF ``LlamaForCausalLM`` (sdpa) at the 350M shape, if transformers imports;
* ``host``: STEM-full with its tables and optimizer state in host RAM (``run.tables=host``) ÷ on
  the GPU, and the GPU memory each holds;
* ``decode``: STEM-1/3 tokens/s at batch 1 and 16, tables on the GPU and in host RAM.

Only torch, numpy, safetensors, tokenizers and pyyaml need to be importable. Writes
``benchmarks/results/gpu_suite.json`` (``gpu_suite.quick.json`` for a dry run) with the device
name, torch and CUDA versions and the commit. See docs/gpu.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from pathlib import Path

import torch
from _gpu_parts import (decode_section, free, hf_section, host_section, matmul_peak, spec_peak, step_fn,
                        train_section, trainers_for, ARMS)
from _train_bench import synthetic_data_dir, write_result

SHAPES = {"350m": "mobilellm-350m", "1b": "llama3.2-1b"}
SECTIONS = ("train", "hf", "host", "decode")


def settings(dry_run: bool, args) -> dict:
    """What the suite runs: full size on CUDA, tiny on the CPU for ``--dry-run``."""
    if dry_run:
        s = {"device": "cpu", "dtype": "float32", "batch": 2, "seq": 32, "vocab": 512, "steps": 2, "warmup": 1,
             "compile": args.compile_in_dry_run, "decode_tokens": 3, "presets": {k: "debug" for k in SHAPES},
             "data": [f"data.dir={synthetic_data_dir(512, n_tokens=20_000)}"]}
    else:
        if not torch.cuda.is_available():
            raise SystemExit("gpu_suite: no CUDA device; use --dry-run for the CPU smoke run")
        s = {"device": "cuda", "dtype": "bfloat16", "batch": 16, "seq": 512, "vocab": 4096, "steps": args.steps,
             "warmup": 3, "compile": True, "decode_tokens": 100, "presets": dict(SHAPES), "data": [corpus_override()]}
    s["presets"] = {k: v for k, v in s["presets"].items() if k in args.shapes}
    return s


def corpus_override() -> str:
    """``data.dir=`` the prepared default corpus under ``$STEMLM_CACHE``, else random Zipf tokens."""
    root = Path(os.environ.get("STEMLM_CACHE", Path.home() / ".cache" / "stemlm")) / "data" / "default-v1"
    return f"data.dir={root if (root / 'meta.json').exists() else synthetic_data_dir(4096)}"


def run_suite(s: dict, sections: tuple[str, ...], profile: bool) -> dict:
    """Every selected section, in order; a section that fails is recorded with its error."""
    out: dict = {"train": {}, "profile": None}
    steps = [("train", k, train_section) for k in s["presets"]] + [("hf", "350m", hf_section),
                                                                    ("host", "350m", host_section),
                                                                    ("decode", "350m", decode_section)]
    for section, shape, fn in steps:
        if section not in sections or shape not in s["presets"]:
            continue
        t0 = time.perf_counter()
        try:
            result = fn(s, s["presets"][shape])
        except torch.cuda.OutOfMemoryError as e:
            result = {"error": f"out of memory: {str(e).splitlines()[0]}"}
            free(s)
        if isinstance(result, dict):
            result["section_s"] = time.perf_counter() - t0
            if "dense_model" in result:
                result["dense_model"] = result["dense_model"].to_dict()
        print(f"  {section} {shape}: {time.perf_counter() - t0:.0f} s", flush=True)
        if section == "train":
            out["train"][shape] = result
        else:
            out[section] = result
    if profile and "350m" in s["presets"]:
        out["profile"] = profile_table(s)
    peak_dtype = torch.bfloat16 if s["device"] == "cuda" else torch.float32
    out["matmul_peak"] = matmul_peak(s["device"], peak_dtype, 8192 if s["device"] == "cuda" else 256)
    return out


def profile_table(s: dict, steps: int = 3) -> str:
    """``torch.profiler`` table of a few steps of STEM-full at the 350M shape, after warm-up."""
    from torch.profiler import ProfilerActivity, profile

    trainer = trainers_for(s, s["presets"]["350m"], {"stem-full": ARMS["stem-full"]})["stem-full"]
    run = step_fn(trainer)
    for _ in range(s["warmup"]):
        run()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if s["device"] == "cuda" else [])
    with profile(activities=acts) as prof:
        for _ in range(steps):
            run()
    key = "cuda_time_total" if s["device"] == "cuda" else "cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=25)


def goals(r: dict, s: dict, dry_run: bool, device_name: str) -> list[dict]:
    """The issue's goals with the measured value and met / not met / unmeasured."""
    rows = []

    def add(goal, value, ok):
        status = "unmeasured" if value is None or dry_run else ("met" if ok else "not met")
        rows.append({"goal": goal, "measured": value, "status": status + (" (dry run)" if dry_run else "")})

    for shape, t in r["train"].items():
        for mode, slack in (("compiled", 0.05), ("eager", 0.10)):
            for arm in ("stem-full", "stem-1/3"):
                m = (t.get(mode) or {})
                ratio, flop = m.get("ratio_to_dense", {}).get(arm), m.get("flop_ratio", {}).get(arm)
                add(f"{shape} {mode}: {arm} ÷ dense step ≤ FLOP ratio + {slack:.2f}",
                    None if ratio is None else f"{ratio:.3f} vs {flop:.3f} + {slack:.2f}",
                    ratio is not None and ratio <= flop + slack)
    t = r["train"].get("350m", {})
    mfu = None
    peak = spec_peak(device_name) or r["matmul_peak"]
    if "compiled" in t:
        mfu = t["flops_per_token"]["dense"] * t["tokens_per_step"] / t["compiled"]["step_s"]["dense"] / peak
    add("350m compiled: dense MFU ≥ 40 % of bf16 peak", None if mfu is None else f"{100 * mfu:.1f} %", (mfu or 0) >= 0.40)
    hf = r.get("hf")
    add("350m: stemlm dense ≥ 1.5× HF Llama", None if not hf or "error" in hf else f"{hf['hf_over_stemlm']:.2f}×",
        bool(hf) and hf.get("hf_over_stemlm", 0) >= 1.5)
    h = r.get("host") or {}
    ratio = h.get("host_over_device")
    add("host-RAM tables: step ≥ 0.9× all-on-GPU", None if ratio is None else f"{1 / ratio:.3f}×",
        ratio is not None and 1 / ratio >= 0.9)
    held = h.get("host_between_steps_bytes")
    add("host-RAM tables: GPU memory ≤ backbone + its optimizer + rows of two steps",
        None if held is None else f"{held / 1e9:.2f} GB vs {h['bound_bytes'] / 1e9:.2f} GB",
        held is not None and held <= h["bound_bytes"])
    d = r.get("decode") or {}
    b1, b16, host1 = d.get("device_b1_tok_s"), d.get("device_b16_tok_s"), d.get("host_b1_tok_s")
    eager = d.get("device_b1_eager_tok_s")
    add("decode batch 1 (350m) ≥ 250 tok/s and ≥ 5× the eager decode",
        None if b1 is None else f"{b1:.0f} tok/s ({d.get('device_b1_mode')}), {b1 / eager:.1f}× eager {eager:.0f}",
        (b1 or 0) >= 250 and bool(eager) and b1 / eager >= 5)
    same = all(v for k, v in d.items() if k.endswith("_same_tokens"))
    add("decode: every setting gives the eager device run's tokens", None if not d else str(same), same)
    add("decode host tables ≥ 0.95× device tables", None if not (b1 and host1) else f"{host1 / b1:.2f}×",
        bool(b1 and host1) and host1 / b1 >= 0.95)
    add("decode batch 16 ≥ 8× batch 1", None if not (b1 and b16) else f"{b16 / b1:.1f}×", bool(b1 and b16) and b16 / b1 >= 8)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, seconds; goals stay unmeasured")
    ap.add_argument("--compile-in-dry-run", action="store_true", help="also compile the blocks in a dry run (slow on CPU)")
    ap.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {','.join(SECTIONS)}")
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated subset of {','.join(SHAPES)}")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per arm (default 10)")
    ap.add_argument("--profile", action="store_true", help="add a profiler table of STEM-full steps at the 350M shape")
    args = ap.parse_args()
    args.shapes = tuple(x for x in args.shapes.split(",") if x)
    sections = tuple(x for x in args.sections.split(",") if x)
    bad = [x for x in (*sections, *args.shapes) if x not in (*SECTIONS, *SHAPES)]
    if bad:
        ap.error(f"unknown section or shape {bad[0]!r}")
    t0 = time.perf_counter()
    s = settings(args.dry_run, args)
    device_name = torch.cuda.get_device_name() if s["device"] == "cuda" else f"cpu ({platform.processor() or platform.machine()})"
    print(f"gpu_suite on {device_name}, torch {torch.__version__}, CUDA {torch.version.cuda}", flush=True)
    r = run_suite(s, sections, args.profile)
    rows = goals(r, s, args.dry_run, device_name)
    print(format_report(r, rows))
    payload = {"device": device_name, "torch": torch.__version__, "cuda": torch.version.cuda, "dry_run": args.dry_run,
               "settings": {k: v for k, v in s.items() if k != "data"}, "data": s["data"][0], "results": r,
               "goals": rows, "wall_s": time.perf_counter() - t0}
    print(f"wrote {write_result('gpu_suite', args.dry_run, payload)} ({payload['wall_s']:.0f} s)")


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
    for name in ("hf", "host", "decode"):
        if r.get(name):
            lines.append(f"{name}: " + ", ".join(f"{k}={_fmt(v)}" for k, v in r[name].items() if k != "preset"))
    if r.get("profile"):
        lines.append(r["profile"])
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
