"""The measurements of ``gpu_suite.py``, one function per section; each returns plain data.

Everything here imports only torch, numpy and stemlm (whose training and inference paths need
only torch, numpy, safetensors, tokenizers and pyyaml): the suite runs on a GPU machine where
nothing can be installed. Hugging Face transformers is used when importable, else skipped.
"""

from __future__ import annotations

import re
import statistics
import time

import torch
from _train_bench import make_trainer, paired_ratio, time_interleaved

from stemlm.accounting import roofline_step_s, train_flops_per_token
from stemlm.train.build import compile_blocks
from stemlm.train.metrics import matmul_flops, spec_bf16_peak

ARMS = {"dense": ["model.ffn=dense"], "stem-1/3": ["model.ffn=stem", "model.stem_layers=1/3"],
        "stem-full": ["model.ffn=stem", "model.stem_layers=full"]}
# GEMM kernels by name (cuBLAS / CUTLASS / nvjet on Hopper, oneDNN/MKL ops on the CPU); everything else is "other"
GEMM_NAME = re.compile(r"gemm|nvjet|cutlass|xmma|matmul|aten::mm|aten::addmm|aten::bmm|sm90_|sm80_", re.I)


def error_text(e: Exception) -> str:
    """``Type: first line`` of an exception: what a section that broke records instead of its figures."""
    return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"


def sync(device: torch.device) -> None:
    """Wait for the device (timing fences only)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def step_fn(trainer):
    """One real training step of ``trainer`` (``Trainer.train_step``), fenced for timing."""
    def run():
        trainer.train_step()
        sync(trainer.device)
    return run


def trainers_for(s, preset: str, arms: dict[str, list[str]], extra: list[str] = ()) -> dict:
    """One trainer per arm on the suite's data, batch, dtype and device (``s``: suite settings)."""
    common = [*s["data"], f"data.batch_size={s['batch']}", f"data.seq_len={s['seq']}",
              f"model.max_seq_len={max(s['seq'], 64)}", f"model.vocab_size={s['vocab']}", f"run.device={s['device']}",
              f"run.dtype={s['dtype']}", "run.steps=100000", "run.compile=false", *extra]  # blocks compiled by the suite
    return {arm: make_trainer([*common, *o], preset=preset) for arm, o in arms.items()}


def train_section(s, preset: str, arms: dict | None = None, extra: tuple[str, ...] = (),
                  modes: tuple[str, ...] | None = None) -> dict:
    """Step times of dense, STEM-1/3 and STEM-full, eager then with compiled blocks, interleaved;
    each STEM arm's paired time ratio to dense next to its training-FLOP ratio and its roofline
    ratio (FLOPs at the measured GEMM rate + optimizer and table bytes at the measured bandwidth)."""
    trainers = trainers_for(s, preset, arms or ARMS, list(extra))
    flops = {arm: train_flops_per_token(t.model.cfg, s["seq"]) for arm, t in trainers.items()}
    tokens = trainers["dense"].tokens_per_step
    micro = tokens // trainers["dense"].cfg.optim.grad_accum
    roof = {arm: roofline_step_s(t.model.cfg, s["seq"], tokens, s["rates"]["gemm"], s["rates"]["bandwidth"],
                                 slots=min(tokens, t.model.cfg.vocab_size)) for arm, t in trainers.items()}
    out = {"preset": preset, "table_path": {a: t.table_path for a, t in trainers.items()},
           "table_kernels": {a: t.table_kernels for a, t in trainers.items()}, "extra": list(extra),
           "flops_per_token": flops, "tokens_per_step": tokens, "tokens_per_micro_batch": micro,
           "roofline_step_s": roof, "roofline_ratio": {a: roof[a] / roof["dense"] for a in trainers if a != "dense"}}
    modes = modes or (("eager",) + (("compiled",) if s["compile"] else ()))
    for mode in modes:
        if mode == "compiled":
            t0 = time.perf_counter()
            for t in trainers.values():
                compile_blocks(t.model)
            out["compile_started_s"] = time.perf_counter() - t0
        samples: dict = {}
        t0 = time.perf_counter()
        med = time_interleaved({a: step_fn(t) for a, t in trainers.items()}, s["steps"], s["warmup"], samples)
        out[mode] = {"step_s": med, "wall_s": time.perf_counter() - t0,
                     "ratio_to_dense": {a: paired_ratio(samples[a], samples["dense"]) for a in trainers if a != "dense"},
                     "flop_ratio": {a: flops[a] / flops["dense"] for a in trainers if a != "dense"}}
    out["dense_model"] = trainers["dense"].model.cfg
    del trainers
    free(s)
    return out


def accum_section(s, preset: str) -> dict:
    """Dense and STEM-full with ``optim.grad_accum=8`` (8 × 16 × 512 tokens per step; ``s["accum"]``: 2 in a dry
    run, whose Triton kernels run interpreted), compiled blocks,
    and the same with the whole step captured (``run.step_graph=graph`` on CUDA; ``static`` in a dry run),
    STEM-full there with the loop's table kernels and with ``run.table_kernels=triton-gemm``
    (``graph-gemm``: its ``stem-full`` is that arm, its ``dense`` the same dense samples)."""
    arms = {a: ARMS[a] for a in ("dense", "stem-full")}
    mode = ("compiled",) if s["compile"] else ("eager",)
    accum = f"optim.grad_accum={s['accum']}"
    out = train_section(s, preset, arms, (accum,), mode)
    step_graph = "graph" if s["device"] == "cuda" else "static"
    try:
        fused = {a: o + (["run.table_path=fused"] if a != "dense" else []) for a, o in arms.items()}  # (auto on CUDA)
        fused["stem-full-gemm"] = fused["stem-full"] + ["run.table_kernels=triton-gemm"]
        g = train_section(s, preset, fused, (accum, f"run.step_graph={step_graph}"), mode)[mode[0]]
        out["graph"] = {k: {a: x for a, x in v.items() if a != "stem-full-gemm"} if isinstance(v, dict) else v
                        for k, v in g.items()}
        gemm = {"dense": g["step_s"]["dense"], "stem-full": g["step_s"]["stem-full-gemm"]}
        out["graph-gemm"] = {"step_s": gemm, "ratio_to_dense": {"stem-full": g["ratio_to_dense"]["stem-full-gemm"]},
                             "flop_ratio": {"stem-full": g["flop_ratio"]["stem-full-gemm"]}}
    except Exception as e:  # the compiled figures stand on their own
        out["graph"] = {"error": error_text(e)}
        free(s)
    return out


def graph_section(s, preset: str, table_kernels: str | None = None) -> dict:
    """Dense, STEM-1/3 and STEM-full with the whole step captured as one CUDA graph
    (``run.step_graph=graph``) over compiled blocks; ``static`` (fixed buffers, eager) in a dry run.
    ``table_kernels``: the STEM arms' ``run.table_kernels`` (default: the loop's own, Triton on CUDA)."""
    mode = "graph" if s["device"] == "cuda" else "static"
    stem = ["run.table_path=fused"] + ([f"run.table_kernels={table_kernels}"] if table_kernels else [])
    arms = {a: o + (stem if a != "dense" else []) for a, o in ARMS.items()}  # (fused: auto on CUDA)
    return train_section(s, preset, arms, (f"run.step_graph={mode}",), ("compiled",) if s["compile"] else ("eager",))


def gemm_section(s, preset: str) -> dict:
    """``graph_section`` with the STEM arms' table work in the GEMMs' epilogues (``run.table_kernels=triton-gemm``,
    ``stemlm.kernels.gated_gemm``), dense beside them in the same interleaved rounds."""
    return graph_section(s, preset, "triton-gemm")


def ngram_section(s, preset: str) -> dict:
    """Issue 36's cost on the GPU: n-gram rows (``model.ffn=ngram``, token + hashed bigram and trigram keys) beside
    STEM's token rows at the same placements, dense beside them, captured like the ``graph`` section; ``ngram_over_stem``
    is each placement's paired step ratio (goal ≤ 1.10, as on the CPU)."""
    mode = "graph" if s["device"] == "cuda" else "static"
    fused = ["run.table_path=fused"]
    arms = {"dense": ARMS["dense"],
            **{f"{kind}-{p}": [f"model.ffn={kind}", f"model.stem_layers={p}", *fused]
               for p in ("1/3", "full") for kind in ("stem", "ngram")}}
    out = train_section(s, preset, arms, (f"run.step_graph={mode}",), ("compiled",) if s["compile"] else ("eager",))
    steps = out["compiled" if s["compile"] else "eager"]["step_s"]
    out["ngram_over_stem"] = {p: steps[f"ngram-{p}"] / steps[f"stem-{p}"] for p in ("1/3", "full")}
    return out


def host_section(s, preset: str, arm: str = "stem-full", vocab: int | None = None, cache_rows: int = 0) -> dict:
    """The same STEM model trained with its tables on the device and in host RAM (``run.tables=host``), the
    latter twice: the uncaptured window (``HostTables``, what ``auto`` runs) and the fixed device slab under
    an explicit captured step (``slab``: ``SlabTables``, ``run.step_graph=graph``; ``static`` on the CPU): the
    device memory each holds (between steps, and at a step's peak: each run above what the runs before it
    keep), then step times interleaved."""
    from stemlm.accounting import param_breakdown
    from stemlm.planner import train_window_bytes

    fixed = "run.step_graph=graph" if s["device"] == "cuda" else "run.step_graph=static"
    arms = {"device": ARMS[arm] + ["run.table_path=fused"],
            "host": ARMS[arm] + ["run.tables=host", f"run.table_cache_rows={cache_rows}"],
            "slab": ARMS[arm] + ["run.tables=host", f"run.table_cache_rows={cache_rows}", fixed]}
    if vocab is not None:
        s = {**s, "vocab": vocab}
    trainers, out, base = {}, {"preset": preset, "arm": arm, "vocab": s["vocab"], "cache_rows": cache_rows}, 0
    for name, overrides in arms.items():
        try:
            trainers[name] = trainers_for(s, preset, {name: overrides})[name]
            run = step_fn(trainers[name])
            for _ in range(s["warmup"]):
                run()
        except torch.cuda.OutOfMemoryError as e:  # the slab beside the two others may not fit a smaller card
            if name != "slab":
                raise
            out["slab_error"] = error_text(e)
            trainers.pop(name, None)
        if name not in trainers:
            free(s)  # (after the except block: the exception no longer holds the half-built trainer)
            continue
        if s["device"].startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()
            held = torch.cuda.memory_allocated()
            run()
            out[f"{name}_between_steps_bytes"] = held - base
            out[f"{name}_peak_bytes"] = torch.cuda.max_memory_allocated() - base
            base = torch.cuda.memory_allocated()  # what the device run keeps while the host run is measured
    samples: dict = {}
    med = time_interleaved({a: step_fn(t) for a, t in trainers.items()}, s["steps"], 1, samples)
    out.update(step_s=med, host_over_device=paired_ratio(samples["host"], samples["device"]))
    if "slab" in trainers:
        out["slab_over_device"] = paired_ratio(samples["slab"], samples["device"])
        out["slab_rows_moved"] = dict(trainers["slab"].model.tables.traffic)
    cfg = trainers["host"].model.cfg
    parts = param_breakdown(cfg)
    backbone = sum(parts.values()) - parts["tables"]
    window = train_window_bytes(cfg, trainers["host"].tokens_per_step, 4, 8, 1.0)
    cache = len(cfg.table_layers) * min(cache_rows, cfg.vocab_size) * cfg.d_ff * 4 * 4  # rows, grads, two moments
    out["bound_bytes"] = backbone * 16 + window + cache  # fp32 weights, grads, Adam moments + rows of two steps + cache
    out["rows_moved"] = dict(trainers["host"].model.tables.traffic)
    del trainers
    free(s)
    return out


def hf_section(s, preset: str) -> dict | None:
    """stemlm dense ÷ HF ``LlamaForCausalLM`` (sdpa) step, same shape and batches; None without transformers."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        return None
    from bench_vs_hf import build_hf, hf_step_fn

    trainer = trainers_for(s, preset, {"dense": ARMS["dense"]})["dense"]
    hf = build_hf(trainer.model.cfg).to(trainer.device)
    hf_step = hf_step_fn(trainer, hf, s["dtype"])
    samples: dict = {}
    med = time_interleaved({"stemlm": step_fn(trainer), "hf": lambda: (hf_step(), sync(trainer.device))},
                           s["steps"], s["warmup"], samples)
    del trainer, hf
    free(s)
    return {"preset": preset, "step_s": med, "hf_over_stemlm": paired_ratio(samples["hf"], samples["stemlm"])}


def matmul_peak(device: str, dtype: torch.dtype, n: int) -> float:
    """Measured FLOP/s of an ``n × n`` matmul (best of a few; ``stemlm.train.metrics.matmul_flops``)."""
    return matmul_flops(device, dtype, n)


def spec_peak(device_name: str) -> float | None:
    """The spec-sheet dense bf16 peak of a known card, else None (``stemlm.train.metrics.SPEC_BF16_PEAKS``)."""
    return spec_bf16_peak(device_name)


def copy_bandwidth(device: str, n_bytes: int) -> float:
    """Measured device memory bandwidth, bytes/s: a copy of ``n_bytes`` (read + write counted), best of 5."""
    src = torch.empty(n_bytes // 4, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(5):
        sync(torch.device(device))
        t0 = time.perf_counter()
        dst.copy_(src)
        sync(torch.device(device))
        best = min(best, time.perf_counter() - t0)
    return 2 * n_bytes / best


def kernel_times(prof) -> dict[str, float]:
    """Self device time (µs) of every kernel in a profile (CPU ops when no device was profiled)."""
    events = prof.key_averages()
    cuda = [e for e in events if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA]
    field = "self_device_time_total" if cuda else "self_cpu_time_total"
    return {e.key: float(getattr(e, field, 0.0) or getattr(e, "self_cuda_time_total", 0.0))
            for e in (cuda or [e for e in events if e.key.startswith("aten::")])}


def profile_section(s, preset: str, steps: int = 3) -> dict:
    """Profiler of a few steps of dense and STEM-full, with compiled blocks (on CUDA) and, on CUDA,
    with the whole step captured as one graph (``graph-dense``, ``graph-stem-full``): GPU kernel time,
    of which GEMMs, GPU busy (kernel time ÷ the wall time of as many steps run without the profiler),
    and what the table path adds per micro-batch (STEM-full's non-GEMM kernel time minus dense's,
    compiled blocks), with each arm's top kernels."""
    out = {"preset": preset, "steps": steps}
    runs = [(arm, arm, ()) for arm in ("dense", "stem-full")]
    if s["device"] == "cuda":
        runs += [(f"graph-{arm}", arm, ("run.step_graph=graph",)) for arm in ("dense", "stem-full")]
        runs += [("graph-stem-full-gemm", "stem-full", ("run.step_graph=graph", "run.table_kernels=triton-gemm"))]
    for name, arm, extra in runs:
        try:
            out[name] = _profile_arm(s, preset, arm, extra, steps)
        except Exception as e:  # a graph that fails to capture leaves the compiled figures
            out[name] = {"error": error_text(e)}
            free(s)
    nongemm = {a: out[a]["kernel_ms_per_step"] - out[a]["gemm_ms_per_step"] for a in ("dense", "stem-full")}
    out["table_path_ms_per_micro_batch"] = (nongemm["stem-full"] - nongemm["dense"]) / out["stem-full"]["micro_batches"]
    fused = out.get("graph-stem-full-gemm") or {}
    if "kernel_ms_per_step" in fused and "gemm_ms_per_step" in out.get("graph-stem-full", {}):
        # the table work now runs inside GEMM kernels: what STEM-full's kernels take beyond dense's, less the GEMM
        # time STEM saves (dense's GEMMs minus the unfused STEM-full's cuBLAS GEMMs, both captured)
        dense, unfused = out["graph-dense"], out["graph-stem-full"]
        saved = dense["gemm_ms_per_step"] - unfused["gemm_ms_per_step"]
        out["table_path_gemm_ms_per_micro_batch"] = (fused["kernel_ms_per_step"] - dense["kernel_ms_per_step"]
                                                     + saved) / fused["micro_batches"]
    return out


def _profile_arm(s, preset: str, arm: str, extra: tuple[str, ...], steps: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if s["device"] == "cuda" else [])
    trainer = trainers_for(s, preset, {arm: ARMS[arm]}, list(extra))[arm]
    if s["compile"]:
        compile_blocks(trainer.model)
    run = step_fn(trainer)
    for _ in range(s["warmup"]):
        run()
    t0 = time.perf_counter()
    for _ in range(steps):
        run()
    wall = time.perf_counter() - t0  # without the profiler's own cost
    with profile(activities=acts) as prof:
        for _ in range(steps):
            run()
    k = kernel_times(prof)
    gemm = sum(v for name, v in k.items() if GEMM_NAME.search(name))
    total = sum(k.values())
    out = {"kernel_ms_per_step": total / 1e3 / steps, "gemm_ms_per_step": gemm / 1e3 / steps,
           "busy_fraction": total / 1e6 / wall, "wall_ms_per_step": 1e3 * wall / steps,
           "micro_batches": trainer.cfg.optim.grad_accum,
           "top": sorted(((name, v / 1e3 / steps) for name, v in k.items()), key=lambda x: -x[1])[:12],
           "table": prof.key_averages().table(sort_by="self_cuda_time_total" if s["device"] == "cuda"
                                              else "self_cpu_time_total", row_limit=15)}
    del trainer
    free(s)
    return out


def cli_section(s, preset: str, steps: int) -> dict:
    """Dense at ``preset`` with the training loop's default settings (``run.compile=auto``): the
    tokens/s and MFU that ``stemlm train`` logs (median of ``steps`` records after warm-up)."""
    from stemlm.train.metrics import peak_for

    common = [*s["data"], f"data.batch_size={s['batch']}", f"data.seq_len={s['seq']}",
              f"model.max_seq_len={max(s['seq'], 64)}", f"model.vocab_size={s['vocab']}", f"run.device={s['device']}",
              f"run.dtype={s['dtype']}", "run.steps=100000", *ARMS["dense"]]
    trainer = make_trainer(common, preset=preset)
    trainer.peak_flops, source = peak_for(trainer.device, s["dtype"])
    for _ in range(s["warmup"]):
        trainer.train_step()
    records = [trainer.train_step() for _ in range(steps)]
    out = {"preset": preset, "compiled": trainer.compiled, "peak_flops": trainer.peak_flops, "peak_source": source,
           "tokens_per_s": statistics.median(r["tokens_per_s"] for r in records),
           "mfu": statistics.median(r["mfu"] for r in records)}
    del trainer
    free(s)
    return out


def free(s) -> None:
    """Release cached device memory between sections."""
    import gc
    gc.collect()
    if s["device"].startswith("cuda"):
        torch.cuda.empty_cache()


# -- decode --------------------------------------------------------------------------------------
def decode_section(s, preset: str) -> dict:
    """Decode tokens/s of a STEM-1/3 model (``stemlm.inference.benchmark.decode_benchmark``, the one decode
    core): batch 1 eager (the old path) and graph-captured, batch 16, tables on the device and in host RAM;
    the tokens of every setting are checked equal to the eager device run's."""
    from stemlm import StemLM
    from stemlm.inference.benchmark import decode_benchmark
    from stemlm.presets import model_config
    from stemlm.store import offload_tables

    cfg = model_config(preset, ffn="stem", stem_layers="1/3", vocab_size=s["vocab"])
    n = s["decode_tokens"]
    out = {"preset": preset, "new_tokens": n}
    ref = None
    for tier in ("device", "host"):
        torch.manual_seed(0)
        model = StemLM(cfg).to(s["device"]).eval()
        if tier == "host":
            offload_tables(model, "host")  # Placement("host"): prefetch on
        for batch, graphs in ((1, "off"), (1, "auto"), (16, "auto")):
            if tier == "host" and graphs == "off":
                continue
            r = decode_benchmark(model, batch=batch, new_tokens=n, prompt_len=16, graphs=graphs, repeats=2)
            key = f"{tier}_b{batch}" + ("_eager" if graphs == "off" else "")
            out[f"{key}_tok_s"], out[f"{key}_mode"] = r["decode_tokens_per_s"], r["mode"]  # all rows' tokens
            ref = ref or r["tokens"]
            out[f"{key}_same_tokens"] = r["tokens"] == ref
        del model
        free(s)
    return out
