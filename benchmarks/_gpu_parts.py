"""The measurements of ``gpu_suite.py``, one function per section; each returns plain data.

Everything here imports only torch, numpy and stemlm (whose training and inference paths need
only torch, numpy, safetensors, tokenizers and pyyaml): the suite runs on a GPU machine where
nothing can be installed. Hugging Face transformers is used when importable, else skipped.
"""

from __future__ import annotations

import time

import torch
from _train_bench import make_trainer, paired_ratio, time_interleaved

from stemlm.accounting import train_flops_per_token
from stemlm.train.build import compile_blocks

ARMS = {"dense": ["model.ffn=dense"], "stem-1/3": ["model.ffn=stem", "model.stem_layers=1/3"],
        "stem-full": ["model.ffn=stem", "model.stem_layers=full"]}
# Dense bf16 tensor-core peak (no sparsity) of the cards the suite targets, FLOP/s (vendor spec sheets).
BF16_PEAK = {"H100": 989e12, "H200": 989e12, "A100": 312e12}


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
              f"run.dtype={s['dtype']}", "run.steps=100000", *extra]
    return {arm: make_trainer([*common, *o], preset=preset) for arm, o in arms.items()}


def train_section(s, preset: str) -> dict:
    """Step times of dense, STEM-1/3 and STEM-full, eager then with compiled blocks, interleaved;
    each STEM arm's paired time ratio to dense next to its training-FLOP ratio."""
    trainers = trainers_for(s, preset, ARMS)
    flops = {arm: train_flops_per_token(t.model.cfg, s["seq"]) for arm, t in trainers.items()}
    out = {"preset": preset, "table_path": {a: t.table_path for a, t in trainers.items()},
           "flops_per_token": flops, "tokens_per_step": trainers["dense"].tokens_per_step}
    modes = ["eager"] + (["compiled"] if s["compile"] else [])
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


def host_section(s, preset: str, arm: str = "stem-full") -> dict:
    """The same STEM model trained with its tables on the device and in host RAM (``run.tables=host``):
    the device memory each holds (between steps, and at a step's peak: the device run measured
    first, the host run above what the device run keeps), then step times interleaved."""
    from stemlm.accounting import param_breakdown
    from stemlm.planner import train_window_bytes

    arms = {"device": ARMS[arm] + ["run.table_path=fused"], "host": ARMS[arm] + ["run.tables=host"]}
    trainers, out, base = {}, {"preset": preset, "arm": arm}, 0
    for name, overrides in arms.items():
        trainers[name] = trainers_for(s, preset, {name: overrides})[name]
        run = step_fn(trainers[name])
        for _ in range(s["warmup"]):
            run()
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
    cfg = trainers["host"].model.cfg
    parts = param_breakdown(cfg)
    backbone = sum(parts.values()) - parts["tables"]
    window = train_window_bytes(cfg, trainers["host"].tokens_per_step, 4, 8, 1.0)
    out["bound_bytes"] = backbone * 16 + window  # fp32 weights, grads, Adam moments + rows of two steps
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
    """Measured FLOP/s of an ``n × n`` matmul (best of a few)."""
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    best = float("inf")
    for _ in range(5):
        sync(torch.device(device))
        t0 = time.perf_counter()
        for _ in range(4):
            a @ b
        sync(torch.device(device))
        best = min(best, (time.perf_counter() - t0) / 4)
    return 2 * n ** 3 / best


def spec_peak(device_name: str) -> float | None:
    """The spec-sheet dense bf16 peak of a known card, else None."""
    return next((v for k, v in BF16_PEAK.items() if k in device_name), None)


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
