"""P2: table optimizer step, SparseRowAdamW ÷ dense torch AdamW, and how each scales.

A table of V × d_ff (default 32000 × 2560) receives the gradient of one training step: the
unique ids of a Zipf draw of B·L = 8192 tokens (a few thousand rows). The sparse optimizer
coalesces and updates only those U rows; torch AdamW updates all V rows from a dense gradient
(the official code's setup). Each side is timed in two parts, interleaved in the same run:

* ``step``: the optimizer step alone — ``SparseRowAdamW.step()`` (coalesce + row update; eager,
  and with ``compile=True``: one compiled gather-update-scatter kernel), and the fused table path's
  ``FusedRowAdamW.step()`` (``sparse_fused``: the step's rows are one leaf whose gradient needs no
  coalescing, the update is compiled; docs/gpu.md) against ``AdamW.step()`` +
  ``zero_grad(set_to_none=False)``. This is the P2 metric.
* ``lookup_backward``: the table lookup of the 8192 positions and its backward (for dense, this
  writes the V × d_ff gradient). Reported so the whole table cost per step is visible too.

Dense baselines: ``torch.optim.AdamW(params)`` with torch's defaults, as the official code calls it
(on CPU torch then runs its single-tensor implementation), and ``fused=True`` (torch's fused CPU
kernel), the fastest dense AdamW available here. Sweeps show the sparse cost follows U and the
dense cost follows V.

    python benchmarks/bench_sparse_optim.py
    python benchmarks/bench_sparse_optim.py --quick
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from _train_bench import write_result, zipf_tokens

from stemlm.train.fused import FusedRowAdamW, install_fused_tables
from stemlm.model.tables import StemTable, Tables
from stemlm.runtime.malloc import keep_freed_memory
from stemlm.train.sparse_adam import SparseRowAdamW

SPARSE = ("sparse", "sparse_compiled", "sparse_fused")


class TableSide:
    """One table with its optimizer: ``lookup_backward()`` then ``step()``, as a training step does."""

    def __init__(self, V: int, d: int, ids: torch.Tensor, optimizer: str):
        self.table = StemTable(V, d)
        torch.nn.init.normal_(self.table.weight, std=0.02)
        self.ids = ids
        self.grad_out = None
        self.fused = optimizer == "sparse_fused"
        self.sparse = optimizer.startswith("sparse")
        if self.fused:  # the table as the only member of a FusedTables
            holder = torch.nn.Module()
            holder.tables = {"0": self.table}
            self.tables = install_fused_tables(holder)
            self.opt = FusedRowAdamW(self.tables, lr=1e-3, weight_decay=0.1, compile=True)
        elif optimizer.startswith("sparse"):
            self.tables = Tables({"0": self.table})
            self.opt = SparseRowAdamW(self.tables, lr=1e-3, weight_decay=0.1, compile=optimizer == "sparse_compiled")
        else:
            self.opt = torch.optim.AdamW(self.table.parameters(), lr=1e-3, weight_decay=0.1,
                                         fused=optimizer == "dense_fused" or None)

    def lookup_backward(self) -> None:
        if self.fused:
            self.tables.begin_step([self.ids])
        rows = self.tables.rows(self.ids)["0"] if self.sparse else self.table.lookup(self.ids)  # (N, d)
        if self.grad_out is None:
            self.grad_out = torch.randn(rows.shape, generator=torch.Generator().manual_seed(0)) * 1e-3
        rows.backward(self.grad_out)

    def step(self) -> None:
        self.opt.step()
        if not self.sparse:
            self.opt.zero_grad(set_to_none=False)  # keep the dense V x d grad buffer, as a training loop does


def time_sides(sides: dict[str, TableSide], steps: int, warmup: int = 2) -> dict[str, dict[str, float]]:
    """Median seconds of ``lookup_backward`` and ``step`` per side, sides interleaved step by step."""
    times = {k: {"lookup_backward": [], "step": []} for k in sides}
    for i in range(warmup + steps):
        for name, side in sides.items():
            t0 = time.perf_counter()
            side.lookup_backward()
            t1 = time.perf_counter()
            side.step()
            t2 = time.perf_counter()
            if i >= warmup:
                times[name]["lookup_backward"].append(t1 - t0)
                times[name]["step"].append(t2 - t1)
    return {k: {part: statistics.median(v) for part, v in parts.items()} for k, parts in times.items()}


def ids_with_unique(n_tokens: int, vocab: int, unique: int | None, seed: int = 0) -> torch.Tensor:
    """``n_tokens`` Zipf ids; with ``unique`` set, remapped onto exactly that many distinct rows."""
    toks = torch.from_numpy(zipf_tokens(n_tokens, vocab, seed=seed))
    if unique is not None:
        uniq, inv = torch.unique(toks, return_inverse=True)
        toks = (inv % unique) * (vocab // unique)  # spread over the table
    return toks


def measure(V: int, d: int, ids: torch.Tensor, steps: int, dense: tuple[str, ...] = ("dense", "dense_fused"),
            sparse: tuple[str, ...] = SPARSE) -> dict:
    """Times of the sparse sides and the given dense sides on one table shape and one id draw."""
    sides = {k: TableSide(V, d, ids, k) for k in sparse + dense}
    t = time_sides(sides, steps)
    out = {"V": V, "d_ff": d, "unique": int(torch.unique(ids).numel())}
    for name, parts in t.items():
        out[f"{name}_step_s"] = parts["step"]
        out[f"{name}_lookup_backward_s"] = parts["lookup_backward"]
    for name in dense:
        for sp in sparse:
            out[f"{name}_over_{sp}_step"] = t[name]["step"] / t[sp]["step"]
            out[f"{name}_over_{sp}_total"] = sum(t[name].values()) / sum(t[sp].values())
    del sides
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--d-ff", type=int, default=2560)
    ap.add_argument("--tokens", type=int, default=8192, help="B·L tokens per step")
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--quick", action="store_true", help="small table, 1 step, writes sparse_optim.quick.json")
    args = ap.parse_args()
    keep_freed_memory()  # as training does: no page faults on the scratch tensors of every step
    if args.quick:
        args.vocab, args.d_ff, args.tokens, args.steps = 4000, 128, 1024, 1
    V, d = args.vocab, args.d_ff
    ms = lambda s: f"{1000 * s:7.1f} ms"  # noqa: E731
    main_row = measure(V, d, ids_with_unique(args.tokens, V, None), args.steps)
    print(f"V={V} d_ff={d}, Zipf draw of {args.tokens} tokens -> U={main_row['unique']} unique rows "
          f"({torch.get_num_threads()} threads)")
    print(f"{'':24}{'step':>10}{'lookup+bwd':>13}")
    for name in (*SPARSE, "dense", "dense_fused"):
        print(f"  {name:<22}{ms(main_row[f'{name}_step_s'])}{ms(main_row[f'{name}_lookup_backward_s'])}")
    for name, label in (("dense", "torch AdamW (defaults)"), ("dense_fused", "torch AdamW fused=True")):
        for sp in SPARSE:
            print(f"  {label} / {sp}: step {main_row[f'{name}_over_{sp}_step']:.1f}x, "
                  f"lookup+backward+step {main_row[f'{name}_over_{sp}_total']:.1f}x")
    sweep_v = [measure(v, d, ids_with_unique(args.tokens, v, None), args.steps, dense=("dense",), sparse=("sparse",))
               for v in (V // 4, V // 2, V)]
    print("sweep V (Zipf ids), step:  " + "  ".join(
        f"V={r['V']}: U={r['unique']} sparse {ms(r['sparse_step_s'])} dense {ms(r['dense_step_s'])}" for r in sweep_v))
    units = [u for u in (250, 1000, 4000) if u < V] if not args.quick else [50, 200]
    sweep_u = [measure(V, d, ids_with_unique(args.tokens, V, u), args.steps, dense=(), sparse=("sparse",))
               for u in units]
    print("sweep U (V fixed), step:   " + "  ".join(f"U={r['unique']}: sparse {ms(r['sparse_step_s'])}" for r in sweep_u))
    path = write_result("sparse_optim", args.quick, {"main": main_row, "sweep_vocab": sweep_v, "sweep_unique": sweep_u})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
