"""Two GPU checks the suite does not make, in about a minute (docs/gpu.md):

* ``kernels``: the Triton table kernels (``stemlm.kernels.gated_rows``) against their torch reference
  on the device at the 350M shape of one micro-batch (16 × 512 positions, d_ff 2560, Zipf ids over a
  4096 vocabulary, bf16 gate): relative errors, and each pass's time (CUDA events, median of 20)
  with the bandwidth it reaches (bytes it must move ÷ time) next to the reference's time;
* ``gemm``: the GEMMs with table epilogues (``stemlm.kernels.gated_gemm``, ``run.table_kernels=triton-gemm``)
  at the 350M layer shape (x ``(8192, 960)``, d_ff 2560, bf16): their outputs against cuBLAS GEMMs + the
  ``gated_rows`` kernels, and the times of both per layer (forward: gate GEMM + gathered product; backward:
  the ``dh`` GEMM + the segmented row gradient), with cuBLAS's gate GEMM alone for the Triton GEMM's rate;
* ``graph``: the loop's losses with ``run.step_graph=auto`` (the whole step captured as one CUDA
  graph; ``static``, the same step uncaptured, in a dry run) against the eager loop's (same seed, compiled blocks in both), dense, STEM-full
  and STEM-1/3 with its tables in the dense optimizer (``optim.table_optimizer=dense``), with
  ``optim.grad_accum=2``, and the step times of both; and STEM-full's captured step with host-RAM tables
  through the fixed device slab (``SlabTables``) against the same step with device tables (bit for bit);
* ``tune`` (with ``--tune``, first): each table kernel timed under a few tile sizes and warps
  (``CANDIDATES``; the first of each list is the shipped default) at the same shape, the AdamW over
  the touched rows of a 31-layer stack; a candidate counts only when its outputs equal the default's
  (forward, gate gradient and AdamW bit for bit; the row gradient within 1e-5, its summation order
  follows ``CHUNK``). The fastest of each kernel are written to ``--tune-out`` (default
  ``results/kernel_configs.json``) and used by the two checks after it; another process takes them
  with ``STEMLM_TABLE_KERNEL_CONFIGS=<that file>`` (``stemlm/kernels/configs.py``).

    python benchmarks/gpu_checks.py            # on one GPU; writes results/gpu_checks.json
    python benchmarks/gpu_checks.py --tune --tune-out $OUT/kernel_configs.json   # tune first
    python benchmarks/gpu_checks.py --dry-run  # the same on the CPU at tiny shapes (Triton interpreter)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from _gpu_parts import error_text
from _train_bench import RESULTS, make_trainer, synthetic_data_dir, write_result

from stemlm.runtime.files import atomic_write_text


REPS = 20
WARMUP = 2  # calls before the timed ones (compilation, autotuning caches)
GEMM_D = 960  # d_model of the 350M shape (mobilellm-350m)


def _gemm(m: int, n: int, k: int, warps: int, stages: int) -> dict:
    return {"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k, "GROUP_M": 8, "num_warps": warps, "num_stages": stages}

# tile sizes and warps tried by --tune; the first of each kernel is the shipped default (configs.DEFAULTS)
CANDIDATES = {
    "forward": [{"BLOCK_N": 8, "BLOCK_F": 256, "num_warps": 4}, {"BLOCK_N": 16, "BLOCK_F": 128, "num_warps": 4},
                {"BLOCK_N": 16, "BLOCK_F": 256, "num_warps": 4}, {"BLOCK_N": 4, "BLOCK_F": 256, "num_warps": 4},
                {"BLOCK_N": 8, "BLOCK_F": 256, "num_warps": 2}, {"BLOCK_N": 8, "BLOCK_F": 128, "num_warps": 2},
                {"BLOCK_N": 64, "BLOCK_F": 128, "num_warps": 8}, {"BLOCK_N": 8, "BLOCK_F": 512, "num_warps": 4}],
    "backward_tiles": [{"CHUNK": 64, "BLOCK_F": 32, "num_warps": 4}, {"CHUNK": 32, "BLOCK_F": 128, "num_warps": 4},
                       {"CHUNK": 64, "BLOCK_F": 64, "num_warps": 4}, {"CHUNK": 32, "BLOCK_F": 32, "num_warps": 4},
                       {"CHUNK": 16, "BLOCK_F": 64, "num_warps": 4}, {"CHUNK": 32, "BLOCK_F": 64, "num_warps": 2},
                       {"CHUNK": 16, "BLOCK_F": 128, "num_warps": 4}, {"CHUNK": 32, "BLOCK_F": 64, "num_warps": 4}],
    "backward_rows": [{"BLOCK_S": 16, "BLOCK_F": 128, "num_warps": 4}, {"BLOCK_S": 8, "BLOCK_F": 256, "num_warps": 4},
                      {"BLOCK_S": 32, "BLOCK_F": 128, "num_warps": 4}, {"BLOCK_S": 16, "BLOCK_F": 256, "num_warps": 8},
                      {"BLOCK_S": 4, "BLOCK_F": 512, "num_warps": 4}],
    "row_adamw": [{"BLOCK_D": 256, "num_warps": 4}, {"BLOCK_D": 512, "num_warps": 4}, {"BLOCK_D": 1024, "num_warps": 4},
                  {"BLOCK_D": 1024, "num_warps": 8}, {"BLOCK_D": 2048, "num_warps": 8}],
    # the GEMMs with table epilogues: common Hopper bf16 tiles (M x N x K, warps, stages); first: the H200's pick
    "gate_gemm": [_gemm(128, 256, 64, 8, 3), _gemm(128, 128, 64, 8, 3), _gemm(128, 128, 64, 4, 4), _gemm(64, 128, 64, 4, 4),
                  _gemm(128, 64, 64, 4, 4), _gemm(256, 128, 64, 8, 3), _gemm(128, 128, 32, 4, 4)],
    "down_backward": [_gemm(64, 128, 32, 4, 4), _gemm(128, 128, 64, 8, 3), _gemm(64, 256, 64, 8, 3), _gemm(64, 64, 64, 4, 4),
                      _gemm(32, 128, 64, 4, 4), _gemm(128, 64, 64, 4, 4), _gemm(64, 128, 64, 4, 3)],
}
TUNE_LAYERS = 31  # STEM-full at the 350M shape: 31 tables a step


def cuda_ms(fn, reps: int | None = None) -> float:
    """Median milliseconds of ``fn`` over ``reps`` calls after ``WARMUP`` warm-ups (CUDA events; wall time on the
    CPU)."""
    for _ in range(WARMUP):
        fn()
    times = []
    for _ in range(reps or REPS):
        if torch.cuda.is_available():
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """‖a − b‖ / ‖b‖ in fp64."""
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def kernel_inputs(device: str, N: int, F_: int, V: int) -> tuple:
    """One micro-batch's kernel inputs: Zipf ids over ``V``, their ``inverse (N,)``, ``P`` distinct rows
    ``(P, F_)`` fp32, gate and upstream gradient ``(N, F_)`` (bf16 on CUDA)."""
    gen = np.random.default_rng(0)
    ids = torch.from_numpy(np.minimum(gen.zipf(1.2, N), V) - 1).to(device)  # (N,) Zipf over the vocabulary
    uniq, inverse = torch.unique(ids, return_inverse=True)
    P = uniq.numel()
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(0)
    rows = torch.randn(P, F_, device=device)
    g = torch.randn(N, F_, device=device, dtype=dtype)
    dh = torch.randn(N, F_, device=device, dtype=dtype)
    return inverse, P, dtype, rows, g, dh


def _fastest(timings: list[dict]) -> dict:
    """The fastest candidate (``{"config", "ms", "equal"}``) among those whose outputs equal the default's."""
    return min((t for t in timings if t["equal"]), key=lambda t: t["ms"])


def tune_kernels(device: str, N: int, F_: int, V: int, candidates: dict) -> dict:
    """Time every kernel under each candidate config (module doc); return the fastest configs with the
    timings of every candidate, the default's first."""
    from stemlm import kernels
    from stemlm.kernels import configs

    gated, row_adamw = kernels.load(device)
    inverse, P, _, rows, g, dh = kernel_inputs(device, N, F_, V)
    seg = gated.Segments.of(inverse, P)
    best: dict = {}
    timings: dict = {}

    def backward(row_grad):
        return gated.gated_rows_backward(dh, g, rows, seg, row_grad)

    with configs.use({}):
        h0 = gated.gated_rows_forward(g, rows, inverse)
        rg0 = torch.zeros(P, F_, device=device)
        dg0 = backward(rg0)
    for kernel in ("forward", "backward_tiles", "backward_rows"):
        timings[kernel] = []
        for cfg in candidates[kernel]:
            with configs.use({**best, kernel: cfg}):
                if kernel == "forward":
                    equal = bool(torch.equal(gated.gated_rows_forward(g, rows, inverse), h0))
                    ms = cuda_ms(lambda: gated.gated_rows_forward(g, rows, inverse))
                else:
                    rg = torch.zeros(P, F_, device=device)
                    equal = bool(torch.equal(backward(rg), dg0)) and rel(rg, rg0) < 1e-5
                    ms = cuda_ms(lambda: backward(rg))  # both passes (the second depends on the first's CHUNK)
            timings[kernel].append({"config": cfg, "ms": ms, "equal": equal})
        best[kernel] = _fastest(timings[kernel])["config"]

    try:  # the GEMMs' defaults broken on this card: the other kernels' tuning still counts
        gemm_in = gemm_inputs(device, N, F_, V)
        with configs.use({}):
            want = gemm_fused(gemm_in)
        gemm_in["g"] = want[0]  # the gate the backward candidates start from
    except Exception as e:
        print(f"tune gemm defaults: {error_text(e)}", flush=True)
        want = None
    for kernel in ("gate_gemm", "down_backward") if want else ():
        timings[kernel] = []
        for cfg in candidates[kernel]:
            with configs.use({**best, kernel: cfg}):
                try:  # a tile too large for the card's shared memory fails to launch: skipped
                    got = gemm_fused(gemm_in)
                    equal = all(rel(a, b) < 5e-3 for a, b in zip(got, want))  # tiles change the summation order
                    part = "forward" if kernel == "gate_gemm" else "backward"
                    ms = cuda_ms(lambda: gemm_fused(gemm_in, part))
                except Exception as e:
                    equal, ms = False, float("inf")
                    print(f"tune {kernel} {cfg}: {error_text(e)}", flush=True)
            timings[kernel].append({"config": cfg, "ms": ms, "equal": equal})
        best[kernel] = _fastest(timings[kernel])["config"]

    R, K = TUNE_LAYERS * V, TUNE_LAYERS * P  # a stack of tables, the rows one step touches in each
    gen = torch.Generator(device=device).manual_seed(0)
    state = [torch.randn(R, F_, device=device, generator=gen) for _ in range(2)] + [torch.rand(R, F_, device=device, generator=gen)]
    flat = torch.randperm(R, device=device, generator=gen)[:K]
    w_rows, grad = state[0][flat], torch.randn(K, F_, device=device, generator=gen)
    decay = torch.full((K, 1), 0.999, device=device)
    neg_step, eps_r = torch.full((K, 1), -1e-3, device=device), torch.full((K, 1), 1e-8, device=device)

    def adamw(tensors):
        row_adamw.row_adamw_(*tensors, flat, w_rows, grad, decay, neg_step, eps_r, None, 0.9, 0.95)

    want = [t.clone() for t in state]
    with configs.use({}):
        adamw(want)
    timings["row_adamw"] = []
    for cfg in candidates["row_adamw"]:  # every candidate from the same state first, then the timing
        with configs.use({"row_adamw": cfg}):
            got = [t.clone() for t in state]
            adamw(got)
            timings["row_adamw"].append({"config": cfg, "equal": all(bool(torch.equal(a, b)) for a, b in zip(got, want))})
            del got
    for t in timings["row_adamw"]:
        with configs.use({"row_adamw": t["config"]}):
            t["ms"] = cuda_ms(lambda: adamw(state))  # (the state drifts by a few tiny steps: timing only)
    best["row_adamw"] = _fastest(timings["row_adamw"])["config"]
    del state, want
    moved = K * F_ * 4 * 7  # the AdamW's bytes: 4 reads and 3 writes of fp32 a touched element
    return {"N": N, "d_ff": F_, "vocab": V, "distinct_rows": P, "layers": TUNE_LAYERS, "configs": best,
            "timings_ms": timings,
            "speedup_over_default": {k: timings[k][0]["ms"] / _fastest(timings[k])["ms"] for k in timings},
            "row_adamw_GB_per_s": {"default": moved / timings["row_adamw"][0]["ms"] / 1e6,
                                   "best": moved / _fastest(timings["row_adamw"])["ms"] / 1e6}}


def kernel_check(device: str, N: int, F_: int, V: int) -> dict:
    """The gated-rows forward and backward against ``F.silu(g) * rows[inverse]`` under autograd."""
    from stemlm import kernels

    gated, _ = kernels.load(device)
    inverse, P, dtype, rows, g, dh = kernel_inputs(device, N, F_, V)
    seg = gated.Segments.of(inverse, P)
    row_grad = torch.zeros(P, F_, device=device)
    h = gated.gated_rows_forward(g, rows, inverse)
    dg = gated.gated_rows_backward(dh, g, rows, seg, row_grad)
    g_ref, rows_ref = g.float().requires_grad_(True), rows.clone().requires_grad_(True)
    h_ref = F.silu(g_ref) * rows_ref[inverse]
    h_ref.backward(dh.float())
    out = {"N": N, "d_ff": F_, "vocab": V, "distinct_rows": P, "dtype": str(dtype), "configs": kernels.configs.ACTIVE,
           "rel_err": {"h": rel(h, h_ref), "dg": rel(dg, g_ref.grad), "row_grad": rel(row_grad, rows_ref.grad)}}
    e = g.element_size()
    by = {"forward": N * F_ * 2 * e + P * F_ * 4, "backward": N * F_ * 3 * e + P * F_ * 4 * 4}
    ms = {"segments": cuda_ms(lambda: gated.Segments.of(inverse, P)),
          "forward": cuda_ms(lambda: gated.gated_rows_forward(g, rows, inverse)),
          "backward": cuda_ms(lambda: gated.gated_rows_backward(dh, g, rows, seg, row_grad))}

    def reference():
        gr, rr = g.detach().requires_grad_(True), rows.detach().requires_grad_(True)
        (F.silu(gr) * rr.index_select(0, inverse)).backward(dh)
    ms["reference_forward_backward"] = cuda_ms(reference)
    out["ms"] = ms
    out["GB_per_s"] = {k: by[k] / ms[k] / 1e6 for k in by}
    out["min_bytes"] = by
    return out


def gemm_inputs(device: str, N: int, F_: int, V: int) -> dict:
    """One 350M-shape STEM layer's inputs: x ``(N, 960)``, W_g ``(F, 960)``, W_d ``(960, F)``, dy (bf16 on CUDA),
    the rows and ids of ``kernel_inputs``."""
    from stemlm import kernels

    gated, _ = kernels.load(device)
    inverse, P, dtype, rows, _, _ = kernel_inputs(device, N, F_, V)
    D = GEMM_D if device == "cuda" else 48
    gen = torch.Generator(device=device).manual_seed(1)
    x, w_gate, w_down, dy = (torch.randn(*sh, device=device, generator=gen).div_(sh[-1] ** 0.5).to(dtype)
                             for sh in ((N, D), (F_, D), (D, F_), (N, D)))
    return {"x": x, "w_gate": w_gate, "w_down": w_down, "dy": dy, "rows": rows, "inverse": inverse, "P": P,
            "seg": gated.Segments.of(inverse, P), "gated": gated, "gemm": kernels.load_gemm(device)}


def gemm_fused(a: dict, part: str = "both") -> tuple:
    """``(g, h, dg, row_grad)`` of the GEMMs with table epilogues (``part``: only the forward or the backward)."""
    gemm = a["gemm"]
    row_grad = torch.zeros(a["P"], a["rows"].shape[1], device=a["x"].device)
    g, h = gemm.gate_gemm(a["x"], a["w_gate"], a["rows"], a["inverse"]) if part != "backward" else (a["g"], None)
    if part == "forward":
        return g, h
    return g, h, gemm.down_backward(a["dy"], a["w_down"], g, a["rows"], a["seg"], row_grad), row_grad


def gemm_unfused(a: dict, part: str = "both") -> tuple:
    """The same with torch GEMMs around the ``gated_rows`` kernels (``run.table_kernels=triton``)."""
    gated = a["gated"]
    row_grad = torch.zeros(a["P"], a["rows"].shape[1], device=a["x"].device)
    if part != "backward":
        g = a["x"] @ a["w_gate"].t()
        h = gated.gated_rows_forward(g, a["rows"], a["inverse"])
        if part == "forward":
            return g, h
    else:
        g, h = a["g"], None
    dg = gated.gated_rows_backward(a["dy"] @ a["w_down"], g, a["rows"], a["seg"], row_grad)
    return g, h, dg, row_grad


def gemm_check(device: str, N: int, F_: int, V: int) -> dict:
    """The GEMMs with table epilogues against torch GEMMs + the ``gated_rows`` kernels: relative differences
    and per-layer times (module doc)."""
    from stemlm.kernels import configs

    a = gemm_inputs(device, N, F_, V)
    fused, unfused = gemm_fused(a), gemm_unfused(a)
    a["g"] = unfused[0]  # the backward's saved gate, the same for both
    D = a["x"].shape[1]
    ms = {"fused_forward": cuda_ms(lambda: gemm_fused(a, "forward")),
          "unfused_forward": cuda_ms(lambda: gemm_unfused(a, "forward")),
          "fused_backward": cuda_ms(lambda: gemm_fused(a, "backward")),
          "unfused_backward": cuda_ms(lambda: gemm_unfused(a, "backward")),
          "torch_gate_gemm": cuda_ms(lambda: a["x"] @ a["w_gate"].t())}
    ms["saved_per_layer"] = ms["unfused_forward"] + ms["unfused_backward"] - ms["fused_forward"] - ms["fused_backward"]
    flop = 2 * N * D * F_
    return {"N": N, "d_model": D, "d_ff": F_, "distinct_rows": a["P"], "configs": {k: configs.ACTIVE[k]
                                                                                  for k in ("gate_gemm", "down_backward")},
            "rel_err": dict(zip(("g", "h", "dg", "row_grad"), (rel(x, y) for x, y in zip(fused, unfused)))),
            "ms": ms, f"saved_ms_{TUNE_LAYERS}_layers": TUNE_LAYERS * ms["saved_per_layer"],
            "TFLOP_per_s": {"torch_gate_gemm": flop / ms["torch_gate_gemm"] / 1e9,
                            "fused_forward": flop / ms["fused_forward"] / 1e9}}


def graph_check(s: dict) -> dict:
    """Losses and step times of the eager loop and of ``run.step_graph=auto``, dense and STEM-full; and of
    STEM-full's captured step with its tables on the device and in host RAM through the fixed device slab
    (``SlabTables``: ``run.tables=host`` under an explicit ``static``/``graph``), which must agree bit for bit."""
    out = {}
    arms = {"dense": ["model.ffn=dense"], "stem-full": ["model.ffn=stem", "model.stem_layers=full", "run.table_path=fused"],
            # tables trained whole by torch AdamW (the study's paper optimizer): the reference path, captured too
            "stem-1/3-dense-optimizer": ["model.ffn=stem", "model.stem_layers=1/3", "optim.table_optimizer=dense"]}
    pairs = {arm: {"eager": [*o, "run.step_graph=eager"], "auto": [*o, f"run.step_graph={s['captured']}"]}
             for arm, o in arms.items()}
    fixed = f"run.step_graph={'static' if s['captured'] == 'static' else 'graph'}"
    # a slab smaller than the vocabulary, so rows are evicted and loaded again between steps (the GPU step: ~1,050
    # distinct ids of 8,192 tokens in 1,600 slots; the dry run: ~60 a step of 512 ids in 96 slots)
    slab = "run.table_slab_rows=96" if s["captured"] == "static" else "run.table_slab_rows=1600"
    pairs["stem-full-host-slab"] = {"device": [*arms["stem-full"], fixed],
                                    "host": [*arms["stem-full"], fixed, "run.tables=host", slab]}
    for arm, modes in pairs.items():
        try:  # one arm that breaks leaves the others
            out[arm] = _graph_pair(s, modes)
        except Exception as e:
            out[arm] = {"error": error_text(e)}
    return out


def _graph_pair(s: dict, modes: dict) -> dict:
    """Both runs of one ``graph_check`` arm and the largest difference of their losses."""
    runs = {}
    for mode, overrides in modes.items():
        t = make_trainer([*s["common"], *overrides, "optim.grad_accum=2"], preset=s["preset"])
        losses, times = [], []
        for _ in range(s["steps"]):
            t0 = time.perf_counter()
            losses.append(t.train_step()["loss"])
            times.append(time.perf_counter() - t0)
        runs[mode] = {"resolved": t.step_graph, "table_kernels": t.table_kernels, "losses": losses,
                      "tables": type(t.model.tables).__name__, "median_step_s": statistics.median(times[2:]),
                      "traffic": dict(getattr(t.model.tables, "traffic", {}))}
        del t
    a, b = runs.values()
    return {**runs, "max_abs_loss_diff": max(abs(x - y) for x, y in zip(a["losses"], b["losses"]))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes (sets TRITON_INTERPRET=1 before triton loads)")
    ap.add_argument("--tune", action="store_true", help="time each kernel's candidate configs first, keep the fastest")
    ap.add_argument("--tune-out", default=None, help="where --tune writes the configs (default results/kernel_configs.json)")
    args = ap.parse_args()
    candidates = CANDIDATES
    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        device = "cpu"
        shape = (64, 40, 64)
        global REPS, WARMUP
        REPS, WARMUP = 1, 0  # the interpreter's timings mean nothing: each candidate runs, is checked, is timed once
        candidates = {k: v[:2] for k, v in CANDIDATES.items()}  # the interpreter: two of each
        s = {"preset": "debug", "steps": 3, "captured": "static",
             "common": [f"data.dir={synthetic_data_dir(512, n_tokens=20_000)}", "data.batch_size=2", "data.seq_len=32",
                        "run.device=cpu", "run.steps=1000"]}
    else:
        if not torch.cuda.is_available():
            raise SystemExit("gpu_checks: no CUDA device; use --dry-run")
        device = "cuda"
        shape = (16 * 512, 2560, 4096)
        root = os.path.join(os.environ.get("STEMLM_CACHE", os.path.expanduser("~/.cache/stemlm")), "data", "default-v1")
        data = root if os.path.exists(os.path.join(root, "meta.json")) else synthetic_data_dir(4096)
        s = {"preset": "tiny", "steps": 8, "captured": "auto",
             "common": [f"data.dir={data}", "data.batch_size=16", "data.seq_len=256", "run.device=cuda",
                        "run.dtype=bfloat16", "run.steps=1000", "run.compile=true"]}
    t0 = time.perf_counter()
    result = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__}
    if args.tune:
        result["tune"] = tune_kernels(device, *shape, candidates)
        from stemlm.kernels import configs
        configs.ACTIVE = configs.checked(result["tune"]["configs"])  # the checks below run the fastest
        out = Path(args.tune_out) if args.tune_out else RESULTS / f"kernel_configs{'.quick' if args.dry_run else ''}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out, json.dumps({"device": result["device"], "torch": torch.__version__,
                                           "configs": result["tune"]["configs"],
                                           "speedup_over_default": result["tune"]["speedup_over_default"]}, indent=2))
        print(f"tune: {result['tune']['speedup_over_default']} -> {out}", flush=True)
    for name, fn in (("kernels", lambda: kernel_check(device, *shape)), ("gemm", lambda: gemm_check(device, *shape)),
                     ("graph", lambda: graph_check(s))):
        try:
            result[name] = fn()
        except Exception as e:  # one check that breaks leaves the other
            result[name] = {"error": error_text(e)}
        print(f"{name}: {result[name]}", flush=True)
    result["wall_s"] = time.perf_counter() - t0
    print(f"wrote {write_result('gpu_checks', args.dry_run, result)} ({result['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
