"""The row AdamW of the fused table path: one update over the touched rows of every table.

The arithmetic is ``stemlm.row_adam``'s: ``adamw_math_`` is the update of ``stemlm.train.sparse_adam``
written once, with the same operations in the same order (so the eager fused path equals the reference bit
for bit); ``indexed_update_`` applies it to rows picked by an index from stacked ``(rows, dim)`` state
(gather, update, masked write-back), ``window_update_`` here to a compact window of rows in place.
Either runs eager or as one ``torch.compile``-d function: on CUDA inductor turns it into Triton
kernels, on the CPU into OpenMP C++ loops (``compiled``). On the CPU the optimizer uses the
hand-written loop of ``cpu_kernel.py`` instead where it can be built (one pass over the rows where
inductor needs two, the factors computed per row inside it). The per-row factors (bias corrections,
catch-up decay) are computed by ``row_factors`` on ``(n, P)`` counters: tiny tensors, eager.
"""

from __future__ import annotations

import warnings

import torch

from ...row_adam import adamw_math_, indexed_update_, row_factors  # noqa: F401  (this path's update)


def window_update_(w, m, v, g, decay, neg_step, eps_r, b1: float, b2: float) -> None:
    """``adamw_math_`` on a compact window of rows (every row valid), in place."""
    adamw_math_(w, m, v, g, decay, neg_step, eps_r, b1, b2)


class Kernel:
    """One of the update functions, eager or compiled once per process (``dynamic=True``: the
    number of rows changes from step to step on the exact path). A compile failure (no C++
    compiler, an unsupported device) warns once and falls back to the eager function."""

    _compiled: dict = {}

    def __init__(self, fn, compiled: bool):
        self.fn, self.compiled = fn, compiled

    def __call__(self, *args) -> None:
        if self.compiled:
            try:
                fn = Kernel._compiled.get(self.fn.__name__)
                if fn is None:
                    fn = Kernel._compiled[self.fn.__name__] = torch.compile(self.fn, dynamic=True)
                return fn(*args)
            except Exception as e:  # the eager function computes the same update
                first = str(e).splitlines()[0] if str(e) else ""
                warnings.warn(f"fused table path: compiling {self.fn.__name__} failed ({type(e).__name__}: {first}); "
                              "using the eager update", stacklevel=2)
                self.compiled = False
        return self.fn(*args)
