"""Observability of a run: ``metrics.jsonl`` (one line per step), loss-spike counter, MFU.

MFU = achieved training FLOP/s ÷ peak FLOP/s. Training FLOPs per token come from
``stemlm.accounting.train_flops_per_token`` (3 × forward matmul FLOPs, tables free, attention
scores over the full sequence length). The peak is the compute dtype's: ``run.peak_flops`` when
given; for bf16 on a known GPU its spec-sheet dense bf16 peak (``SPEC_BF16_PEAKS``; an unknown GPU
gets a bf16 matmul probe); else a short fp32 matmul probe; cached in the run dir.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from collections import deque
from pathlib import Path

import torch

from ..runtime.files import atomic_write_text
from ..runtime.matmul import mm_nn, onednn_available

PEAK_FILE = "peak_flops.json"


class SpikeDetector:
    """Counts steps whose loss exceeds ``factor`` × the running median of the last ``window`` losses."""

    def __init__(self, factor: float = 3.0, window: int = 50, min_history: int = 10):
        self.factor, self.min_history = factor, min_history
        self.recent: deque[float] = deque(maxlen=window)
        self.count = 0

    def update(self, loss: float) -> bool:
        """Record ``loss``; True when it is a spike (then it is counted, and kept out of the median)."""
        spike = len(self.recent) >= self.min_history and loss > self.factor * statistics.median(self.recent)
        if spike:
            self.count += 1
        else:
            self.recent.append(loss)
        return spike

    def state_dict(self) -> dict:
        return {"count": self.count, "recent": list(self.recent)}

    def load_state_dict(self, state: dict) -> None:
        self.count = int(state["count"])
        self.recent.clear()
        self.recent.extend(float(x) for x in state["recent"])


class MetricsLog:
    """Append-only ``metrics.jsonl``; on resume, lines after the resumed step are dropped first,
    so the file always describes exactly one trajectory."""

    def __init__(self, path: Path, resume_step: int = 0):
        self.path = Path(path)
        keep = []
        if self.path.exists() and resume_step > 0:
            keep = [line for line in self.path.read_text().splitlines() if _step_of(line) <= resume_step]
        atomic_write_text(self.path, "".join(line + "\n" for line in keep))  # a kill here keeps the old file
        self._fh = open(self.path, "a")

    def write(self, record: dict) -> None:
        self._fh.write(json.dumps(record) + "\n")
        self._fh.flush()

    def close(self) -> None:
        self._fh.close()


def _step_of(line: str) -> float:
    """Step of a metrics line; a line cut short by a crash counts as after every checkpoint."""
    try:
        return json.loads(line)["step"]
    except (json.JSONDecodeError, KeyError, TypeError):
        return math.inf


def read_metrics(path: Path) -> list[dict]:
    """All records of a ``metrics.jsonl``."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def measure_peak_flops(device: torch.device | str = "cpu", n: int = 1024, seconds: float = 0.5) -> float:
    """Achieved fp32 matmul FLOP/s of ``n × n`` products for about ``seconds`` (best of the runs).

    On CPU the probe alternates ATen's ``mm`` and oneDNN's kernel (``stemlm.runtime.matmul``) and keeps the
    best of both, so MFU is measured against the fastest GEMM this machine offers.
    """
    a = torch.randn(n, n, device=device)
    b = torch.randn(n, n, device=device)
    backends = ["aten"] + (["onednn"] if torch.device(device).type == "cpu" and onednn_available() else [])
    for backend in backends:
        mm_nn(a, b, backend)  # warm-up
    best, deadline = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < deadline or best == 0.0:
        for backend in backends:
            _sync(device)
            t0 = time.perf_counter()
            mm_nn(a, b, backend)
            _sync(device)
            best = max(best, 2 * n**3 / max(time.perf_counter() - t0, 1e-9))
    return best


# Dense (no sparsity) bf16 tensor-core peaks of the spec sheets, FLOP/s, by a substring of the device name
# (the first match wins: "H100 PCIe" before "H100").
SPEC_BF16_PEAKS = (("H100 PCIe", 756e12), ("H100 NVL", 835e12), ("H100", 989e12), ("H200", 989e12),
                   ("GH200", 989e12), ("A100", 312e12), ("L40S", 362e12), ("A10G", 70e12), ("L4", 121e12))


def spec_bf16_peak(name: str) -> float | None:
    """The spec-sheet dense bf16 peak of a GPU named ``name``, or None when it is not in ``SPEC_BF16_PEAKS``."""
    return next((peak for key, peak in SPEC_BF16_PEAKS if key in name), None)


def matmul_flops(device: torch.device | str, dtype: torch.dtype, n: int, rounds: int = 5, per_round: int = 4) -> float:
    """Achieved FLOP/s of ``n × n`` matmuls in ``dtype`` on ``device``: the best of ``rounds`` timings of
    ``per_round`` products each, after a warm-up product."""
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    a @ b
    best = float("inf")
    for _ in range(rounds):
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(per_round):
            a @ b
        _sync(device)
        best = min(best, (time.perf_counter() - t0) / per_round)
    return 2 * n**3 / max(best, 1e-9)


def measure_bf16_peak(device: torch.device | str, n: int = 4096) -> float:
    """Achieved bf16 matmul FLOP/s of ``n × n`` products on ``device`` (``matmul_flops``; 4096 on an
    accelerator, 1024 suits a CPU)."""
    return matmul_flops(device, torch.bfloat16, n)


def peak_for(device: torch.device, dtype: str = "float32") -> tuple[float, str]:
    """``(peak FLOP/s, where it came from)`` for training in ``dtype`` on ``device``: the peak of the dtype the
    GEMMs run in (under bf16 autocast, bf16: on a CPU with native bf16 instructions about 4x its fp32 peak)."""
    device = torch.device(device)
    if dtype == "bfloat16" and device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        spec = spec_bf16_peak(name)
        if spec is not None:
            return spec, f"spec sheet dense bf16 peak of {name}"
        return measure_bf16_peak(device), f"bf16 matmul 4096^3 probe on {name}"
    if dtype == "bfloat16":
        return measure_bf16_peak(device, 1024), f"bf16 matmul 1024^3 probe on {device.type}"
    return measure_peak_flops(device), "fp32 matmul 1024^3, best of ATen and oneDNN"


def peak_flops_for_run(run_dir: Path, device: torch.device, given: float | None, dtype: str = "float32") -> float:
    """``given``, else the cached peak of this run dir for this device and dtype, else ``peak_for`` (then cached)."""
    if given:
        return float(given)
    cache = Path(run_dir) / PEAK_FILE
    if cache.exists():
        data = json.loads(cache.read_text())
        if data.get("device") == str(device) and data.get("dtype", "float32") == dtype:
            return float(data["peak_flops"])
    peak, probe = peak_for(device, dtype)
    atomic_write_text(cache, json.dumps({"device": str(device), "dtype": dtype, "peak_flops": peak, "probe": probe}))
    return peak


def is_finite(x: float) -> bool:
    return not (math.isnan(x) or math.isinf(x))


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
