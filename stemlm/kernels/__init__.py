"""Triton kernels of the fused table path (``run.table_kernels``), each beside its torch reference.

* ``gated_rows.py``: the STEM product ``SiLU(g) ⊙ U[t]`` read straight from the step's rows (no
  ``(N, d_ff)`` copy of the rows, no cast), and its backward: the gate's gradient and every row's
  gradient as a segmented sum over the positions sorted once per micro-batch (no atomics; long
  segments of hot rows are split across programs and summed in a second pass);
* ``gated_gemm.py`` (``run.table_kernels=triton-gemm``): the same table work moved into the epilogues of
  the GEMMs around it: the gather and product into the gate's GEMM, the backward's first pass into the
  GEMM of the down projection's input gradient (``dh`` is never stored);
* ``row_adamw.py``: the row AdamW of the fused path as one memory-bound pass over the touched rows;
* ``configs.py``: each kernel's tile sizes and warps (defaults, or a file ``gpu_checks.py --tune`` wrote).

The kernels run on CUDA, and on the CPU under the Triton interpreter (``TRITON_INTERPRET=1``, set
here before the kernels are defined when no GPU is asked for), which is how the test suite holds
them equal to the reference path. ``resolve_table_kernels`` picks them: ``auto`` = Triton on CUDA
when ``triton`` imports, torch elsewhere (``triton-gemm`` is asked for by name until a GPU has
measured it). See docs/gpu.md.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys

import torch

from . import configs  # noqa: F401  (tile sizes and warps of each kernel; $STEMLM_TABLE_KERNEL_CONFIGS)

TABLE_KERNELS = ("auto", "triton", "triton-gemm", "torch")
TRITON_KERNELS = ("triton", "triton-gemm")  # the settings that run the Triton kernels


def triton_importable() -> bool:
    """Whether the ``triton`` package is installed (nothing is imported)."""
    return importlib.util.find_spec("triton") is not None


def resolve_table_kernels(setting: str, device: torch.device) -> str:
    """``"triton"``, ``"triton-gemm"`` or ``"torch"`` for ``run.table_kernels=setting`` on ``device`` (one-line
    ``ValueError`` when Triton is asked for and missing)."""
    if setting not in TABLE_KERNELS:
        raise ValueError(f"run.table_kernels must be one of {', '.join(TABLE_KERNELS)}, got {setting!r}")
    if setting == "auto":
        return "triton" if torch.device(device).type == "cuda" and triton_importable() else "torch"
    if setting in TRITON_KERNELS and not triton_importable():
        raise ValueError(f"run.table_kernels={setting} needs the triton package (pip install triton; "
                         "on the CPU it runs under the Triton interpreter)")
    return setting


def load(device: torch.device | str):
    """The kernel modules for tensors on ``device``: ``(gated_rows, row_adamw)``.

    On a CPU the Triton interpreter is switched on first (it must be on when the kernels are
    defined); a process that defined them for a GPU cannot also run them on the CPU.
    """
    cpu = torch.device(device).type == "cpu"
    loaded = "stemlm.kernels.gated_rows" in sys.modules
    if cpu and not loaded:
        os.environ["TRITON_INTERPRET"] = "1"
    if cpu and loaded and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("the Triton table kernels were built for a GPU in this process; "
                           "run CPU tensors through run.table_kernels=torch")
    return importlib.import_module(".gated_rows", __name__), importlib.import_module(".row_adamw", __name__)


def load_gemm(device: torch.device | str):
    """The module of the GEMMs with table epilogues (``gated_gemm``) for tensors on ``device`` (after ``load``)."""
    load(device)
    return importlib.import_module(".gated_gemm", __name__)
