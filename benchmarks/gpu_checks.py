"""Two GPU checks the suite does not make, in about a minute (docs/gpu.md):

* ``kernels``: the Triton table kernels (``stemlm.kernels.gated_rows``) against their torch reference
  on the device at the 350M shape of one micro-batch (16 × 512 positions, d_ff 2560, Zipf ids over a
  4096 vocabulary, bf16 gate): relative errors, and each pass's time (CUDA events, median of 20)
  with the bandwidth it reaches (bytes it must move ÷ time) next to the reference's time;
* ``graph``: the loop's losses with ``run.step_graph=auto`` (the whole step captured as one CUDA
  graph; ``static``, the same step uncaptured, in a dry run) against the eager loop's (same seed, compiled blocks in both), dense and STEM-full with
  ``optim.grad_accum=2``, and the step times of both.

    python benchmarks/gpu_checks.py            # on one GPU; writes results/gpu_checks.json
    python benchmarks/gpu_checks.py --dry-run  # the same on the CPU at tiny shapes (Triton interpreter)
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
import torch
import torch.nn.functional as F
from _gpu_parts import error_text
from _train_bench import make_trainer, synthetic_data_dir, write_result


REPS = 20


def cuda_ms(fn, reps: int | None = None) -> float:
    """Median milliseconds of ``fn`` over ``reps`` calls after two warm-ups (CUDA events; wall time on the CPU)."""
    for _ in range(2):
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


def kernel_check(device: str, N: int, F_: int, V: int) -> dict:
    """The gated-rows forward and backward against ``F.silu(g) * rows[inverse]`` under autograd."""
    from stemlm import kernels

    gated, _ = kernels.load(device)
    gen = np.random.default_rng(0)
    ids = torch.from_numpy(np.minimum(gen.zipf(1.2, N), V) - 1).to(device)  # (N,) Zipf over the vocabulary
    uniq, inverse = torch.unique(ids, return_inverse=True)
    P = uniq.numel()
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(0)
    rows = torch.randn(P, F_, device=device)
    g = torch.randn(N, F_, device=device, dtype=dtype)
    dh = torch.randn(N, F_, device=device, dtype=dtype)
    seg = gated.Segments.of(inverse, P)
    row_grad = torch.zeros(P, F_, device=device)
    h = gated.gated_rows_forward(g, rows, inverse)
    dg = gated.gated_rows_backward(dh, g, rows, seg, row_grad)
    g_ref, rows_ref = g.float().requires_grad_(True), rows.clone().requires_grad_(True)
    h_ref = F.silu(g_ref) * rows_ref[inverse]
    h_ref.backward(dh.float())
    out = {"N": N, "d_ff": F_, "vocab": V, "distinct_rows": P, "dtype": str(dtype),
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


def graph_check(s: dict) -> dict:
    """Losses and step times of the eager loop and of ``run.step_graph=auto``, dense and STEM-full."""
    out = {}
    arms = {"dense": ["model.ffn=dense"], "stem-full": ["model.ffn=stem", "model.stem_layers=full", "run.table_path=fused"]}
    for arm, o in arms.items():
        runs = {}
        for mode in ("eager", "auto"):
            step_graph = s["captured"] if mode == "auto" else mode
            t = make_trainer([*s["common"], *o, f"run.step_graph={step_graph}", "optim.grad_accum=2"], preset=s["preset"])
            losses, times = [], []
            for _ in range(s["steps"]):
                t0 = time.perf_counter()
                losses.append(t.train_step()["loss"])
                times.append(time.perf_counter() - t0)
            runs[mode] = {"resolved": t.step_graph, "table_kernels": t.table_kernels, "losses": losses,
                          "median_step_s": statistics.median(times[2:])}
            del t
        diff = max(abs(a - b) for a, b in zip(runs["eager"]["losses"], runs["auto"]["losses"]))
        out[arm] = {**runs, "max_abs_loss_diff": diff}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes (sets TRITON_INTERPRET=1 before triton loads)")
    args = ap.parse_args()
    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        device = "cpu"
        shape = (64, 40, 64)
        global REPS
        REPS = 1
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
    for name, fn in (("kernels", lambda: kernel_check(device, *shape)), ("graph", lambda: graph_check(s))):
        try:
            result[name] = fn()
        except Exception as e:  # one check that breaks leaves the other
            result[name] = {"error": error_text(e)}
        print(f"{name}: {result[name]}", flush=True)
    result["wall_s"] = time.perf_counter() - t0
    print(f"wrote {write_result('gpu_checks', args.dry_run, result)} ({result['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
