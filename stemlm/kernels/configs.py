"""Tile sizes and warps of the Triton table kernels, one config per kernel.

Every kernel reads its launch config from ``ACTIVE`` when it is called:

* ``forward`` (``gated_rows._forward_kernel``): ``BLOCK_N`` positions × ``BLOCK_F`` columns a program;
* ``backward_tiles`` (the backward's first pass): ``CHUNK`` sorted positions × ``BLOCK_F`` columns;
* ``backward_rows`` (its second pass): ``BLOCK_S`` slots × ``BLOCK_F`` columns;
* ``row_adamw``: one row × ``BLOCK_D`` columns;
* ``gate_gemm`` / ``down_backward`` (``gated_gemm.py``, ``run.table_kernels=triton-gemm``): GEMM tiles of
  ``BLOCK_M`` positions × ``BLOCK_N`` columns, ``BLOCK_K`` deep, ``GROUP_M`` row tiles sharing column tiles
  in L2, ``num_stages`` software-pipeline stages (the one setting that need not be a power of two).

``num_warps`` is each kernel's warps a program. The forward's and the AdamW's configs never change a
number; the backward's ``CHUNK`` (``down_backward``'s ``BLOCK_M``) sets where a hot row's partial sums are
cut, so the row gradients' summation order (last bits) follows it, the same on every run with the same
config; the GEMMs' ``BLOCK_K`` sets their summation order likewise.

``DEFAULTS`` are what the code ships. ``$STEMLM_TABLE_KERNEL_CONFIGS`` names a JSON file of
overrides (``{"forward": {"BLOCK_N": 32}, ...}``; what ``benchmarks/gpu_checks.py --tune`` writes
after timing candidates on the GPU), read when this module is imported; ``use`` sets them in-process.
A config with an unknown kernel or key, or a value that is not a power of two, is refused in one line.
"""

from __future__ import annotations

import copy
import json
import os
from contextlib import contextmanager

ENV = "STEMLM_TABLE_KERNEL_CONFIGS"

# the fastest of benchmarks/gpu_checks.py --tune on one H200 at 8192 positions × d_ff 2560 (d_model 960 for the GEMMs):
# forward (2026-11-27: 0.069 -> 0.052 ms); backward_tiles (2026-11-27: 0.193 -> 0.130 ms; 2026-11-28: CHUNK 64 ×
# BLOCK_F 32 another 1.10×); gate_gemm 1.17× and down_backward 1.11× over the first untimed tiles (2026-11-28,
# benchmarks/results/gpu_h200_2026-11-28/gpu_checks.json); the others within noise of their alternatives
DEFAULTS: dict[str, dict[str, int]] = {
    "forward": {"BLOCK_N": 8, "BLOCK_F": 256, "num_warps": 4},
    "backward_tiles": {"CHUNK": 64, "BLOCK_F": 32, "num_warps": 4},
    "backward_rows": {"BLOCK_S": 16, "BLOCK_F": 128, "num_warps": 4},
    "row_adamw": {"BLOCK_D": 256, "num_warps": 4},
    "gate_gemm": {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8, "num_stages": 3},
    "down_backward": {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 32, "GROUP_M": 8, "num_warps": 4, "num_stages": 4},
}
STAGES = "num_stages"  # any positive integer; every other setting is a power of two


def checked(overrides: dict) -> dict[str, dict[str, int]]:
    """``DEFAULTS`` with ``overrides`` laid over them; ``ValueError`` (one line) on an unknown kernel or key
    or a value that is not a positive power of two (``num_stages``: a positive integer)."""
    out = copy.deepcopy(DEFAULTS)
    if not isinstance(overrides, dict):
        raise ValueError(f"table kernel configs must be a mapping of kernel -> settings, got {type(overrides).__name__}")
    for kernel, settings in overrides.items():
        if kernel not in DEFAULTS:
            raise ValueError(f"unknown table kernel {kernel!r} in the kernel configs (known: {', '.join(DEFAULTS)})")
        if not isinstance(settings, dict):
            raise ValueError(f"table kernel config {kernel!r} must be a mapping, got {type(settings).__name__}")
        for key, value in settings.items():
            if key not in DEFAULTS[kernel]:
                raise ValueError(f"unknown setting {kernel}.{key} in the kernel configs "
                                 f"(known: {', '.join(DEFAULTS[kernel])})")
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"table kernel setting {kernel}.{key} must be a positive integer, got {value!r}")
            if key != STAGES and value & (value - 1):
                raise ValueError(f"table kernel setting {kernel}.{key} must be a power of two, got {value!r}")
            out[kernel][key] = value
    return out


def from_env() -> dict[str, dict[str, int]]:
    """``DEFAULTS`` overlaid by the JSON file ``$STEMLM_TABLE_KERNEL_CONFIGS`` names (when set)."""
    path = os.environ.get(ENV)
    if not path:
        return copy.deepcopy(DEFAULTS)
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"${ENV}={path}: cannot read the kernel configs ({e})") from None
    return checked(data.get("configs", data) if isinstance(data, dict) else data)


ACTIVE: dict[str, dict[str, int]] = from_env()


def launch(kernel: str) -> tuple[dict[str, int], int]:
    """The active ``(meta-parameters, num_warps)`` of ``kernel``."""
    c = dict(ACTIVE[kernel])
    return c, c.pop("num_warps")


def launch_options(kernel: str) -> tuple[dict[str, int], dict[str, int]]:
    """The active ``(meta-parameters, {num_warps, num_stages})`` of ``kernel`` (the GEMM kernels)."""
    c = dict(ACTIVE[kernel])
    return c, {k: c.pop(k) for k in ("num_warps", STAGES) if k in c}


@contextmanager
def use(overrides: dict):
    """Run a block with ``overrides`` laid over the defaults (the benchmark's tuning sweep)."""
    global ACTIVE
    before, ACTIVE = ACTIVE, checked(overrides)
    try:
        yield ACTIVE
    finally:
        ACTIVE = before
