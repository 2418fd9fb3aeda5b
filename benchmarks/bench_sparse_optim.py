"""P2: table optimizer step, SparseRowAdamW ÷ dense torch AdamW, and how each scales.

A table of V × d_ff (default 32000 × 2560) receives the gradient of one training step: the
unique ids of a Zipf draw of B·L = 8192 tokens (a few thousand rows). The sparse optimizer
coalesces and updates only those U rows; torch AdamW updates all V rows from a dense gradient
(the official code's setup). Sweeps show the sparse cost follows U, the dense cost follows V.

    python benchmarks/bench_sparse_optim.py
    python benchmarks/bench_sparse_optim.py --quick
"""

from __future__ import annotations

import argparse

import torch
from _train_bench import time_interleaved, write_result, zipf_tokens

from stemlm.tables import StemTable
from stemlm.train.sparse_adam import SparseRowAdamW


def _sparse_step(V: int, d: int, ids: torch.Tensor):
    """A closure doing lookup-backward-step of the sparse optimizer for ``ids``."""
    table = StemTable(V, d)
    torch.nn.init.normal_(table.weight)
    opt = SparseRowAdamW({"0": table}, lr=1e-3, weight_decay=0.1)
    grad_rows = None

    def step():
        nonlocal grad_rows
        rows = table.lookup(ids)  # (N, d) through the sparse-grad leaf
        grad_rows = torch.ones_like(rows) if grad_rows is None else grad_rows
        rows.backward(grad_rows)
        opt.step()
    return step


def _dense_step(V: int, d: int, ids: torch.Tensor):
    """A closure doing lookup-backward-step of torch AdamW on the whole table."""
    table = StemTable(V, d)
    torch.nn.init.normal_(table.weight)
    opt = torch.optim.AdamW(table.parameters(), lr=1e-3, weight_decay=0.1)
    grad_rows = None

    def step():
        nonlocal grad_rows
        rows = table.lookup(ids)
        grad_rows = torch.ones_like(rows) if grad_rows is None else grad_rows
        rows.backward(grad_rows)
        opt.step()
        opt.zero_grad(set_to_none=False)  # keep the dense V x d grad buffer, as a training loop does
    return step


def ids_with_unique(n_tokens: int, vocab: int, unique: int | None, seed: int = 0) -> torch.Tensor:
    """``n_tokens`` Zipf ids; with ``unique`` set, remapped onto exactly that many distinct rows."""
    toks = torch.from_numpy(zipf_tokens(n_tokens, vocab, seed=seed))
    if unique is not None:
        uniq, inv = torch.unique(toks, return_inverse=True)
        toks = (inv % unique) * (vocab // unique)  # spread over the table
    return toks


def measure(V: int, d: int, ids: torch.Tensor, steps: int, dense: bool = True) -> dict:
    fns = {"sparse": _sparse_step(V, d, ids)}
    if dense:
        fns["dense"] = _dense_step(V, d, ids)
    t = time_interleaved(fns, steps, warmup=1)
    out = {"V": V, "d_ff": d, "unique": int(torch.unique(ids).numel()), "sparse_s": t["sparse"]}
    if dense:
        out["dense_s"] = t["dense"]
        out["sparse_over_dense"] = t["sparse"] / t["dense"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--d-ff", type=int, default=2560)
    ap.add_argument("--tokens", type=int, default=8192, help="B·L tokens per step")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="small table, 1 step, writes sparse_optim.quick.json")
    args = ap.parse_args()
    if args.quick:
        args.vocab, args.d_ff, args.tokens, args.steps = 4000, 128, 1024, 1
    V, d = args.vocab, args.d_ff
    ids = ids_with_unique(args.tokens, V, None)
    main_row = measure(V, d, ids, args.steps)
    print(f"V={V} d_ff={d}, Zipf draw of {args.tokens} tokens -> U={main_row['unique']} unique rows")
    print(f"  sparse {1000 * main_row['sparse_s']:.1f} ms   dense AdamW {1000 * main_row['dense_s']:.1f} ms   "
          f"sparse/dense {main_row['sparse_over_dense']:.3f}")
    sweep_v = [measure(v, d, ids_with_unique(args.tokens, v, None), args.steps) for v in (V // 4, V // 2, V)]
    print("sweep V (Zipf ids):   " + "  ".join(f"V={r['V']}: U={r['unique']} sparse {1000 * r['sparse_s']:.1f} ms "
                                                f"dense {1000 * r['dense_s']:.1f} ms" for r in sweep_v))
    units = [u for u in (250, 1000, 4000) if u < V] if not args.quick else [50, 200]
    sweep_u = [measure(V, d, ids_with_unique(args.tokens, V, u), args.steps, dense=False) for u in units]
    print("sweep U (V fixed):    " + "  ".join(f"U={r['unique']}: sparse {1000 * r['sparse_s']:.1f} ms" for r in sweep_u))
    path = write_result("sparse_optim", args.quick, {"main": main_row, "sweep_vocab": sweep_v, "sweep_unique": sweep_u})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
