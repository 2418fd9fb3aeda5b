"""``run.matmul=auto`` on a CPU: time ATen's and oneDNN's GEMMs at the run's own shapes, keep the faster.

Which of the two is faster for training depends on the CPU, not on the model. Two machines of this
project's CI kind, both reporting themselves as a 2-core "AMD EPYC", disagreed: on one, ATen's step was
3 % faster at every training shape; on the other, oneDNN's was 33–47 % faster (docs/training.md, "GEMMs on
CPU"). A fixed default is wrong on one of them, so ``auto`` measures instead:

* the products timed are the three GEMMs of every distinct bias-free ``nn.Linear`` shape of the model
  (forward ``rows × in @ in × out``, input gradient ``rows × out @ out × in``, weight gradient
  ``out × rows @ rows × in``), weighted by how many linears have it;
* each backend's time is the sum over shapes of the best of ``REPEATS`` products, in rounds that
  alternate A B B A, and the backend's figure is its best round;
* oneDNN is chosen only when ATen takes at least ``ONEDNN_MARGIN`` times as long, so near-ties keep
  PyTorch's own kernels and noise cannot flip a choice between runs;
* the choice is cached per machine (PyTorch version, CPU model and flags, thread count) and shape in
  ``$STEMLM_CACHE/matmul-choices/`` (``stemlm.runtime.cache``): the same machine makes the same choice,
  hence the same losses (the two differ in float summation order only). ``run.matmul=aten|onednn`` skips the probe.

The probe takes well under a second at the ``debug`` shapes and a few seconds at P7's.
"""

from __future__ import annotations

import platform
import time
from collections import Counter
from dataclasses import asdict, dataclass
from hashlib import sha256

import torch
import torch.nn as nn

from .cache import cached_json
from .matmul import mm_nn, mm_nt, resolve_matmul_backend, use_matmul_backend, weight_grad

ONEDNN_MARGIN = 1.10  # oneDNN only when ATen's probe time is at least this multiple of oneDNN's
MAX_ROWS = 2048  # rows of the probed products (time per row is flat above a few hundred rows)
REPEATS = 3  # products per shape and round; the best one counts
CACHE_KIND = "matmul-choices"  # $STEMLM_CACHE/<kind>/, one file per machine and shape
PROBE_VERSION = 3  # part of the cache key: v1 timed the forward and input gradient only, v2 the weight
# gradient with its wide operand copied (before 2026-11-29, ``matmul.weight_grad``)


@dataclass(frozen=True)
class MatmulChoice:
    """The backend ``auto`` picked and what the probe measured (seconds of the weighted GEMMs)."""

    backend: str
    aten_s: float
    onednn_s: float
    rows: int
    cached: bool = False


def linear_shapes(model: nn.Module) -> Counter:
    """``(in_features, out_features) -> count`` over the bias-free linears of ``model``."""
    return Counter((m.in_features, m.out_features) for m in model.modules()
                   if isinstance(m, nn.Linear) and m.bias is None)


def machine_key() -> str:
    """What makes one CPU's GEMM speeds differ from another's: PyTorch, CPU model (name, family, model,
    stepping, flags: hashed) and thread count."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())  # the first processor's
    except OSError:
        pass
    model, flags = fields.get("model name") or platform.processor() or platform.machine(), fields.get("flags", "")
    ident = "|".join(fields.get(k, "") for k in ("cpu family", "model", "stepping"))
    digest = sha256(f"{model}|{ident}|{flags}".encode()).hexdigest()[:12]
    return f"torch {torch.__version__} | {model} {digest} | {torch.get_num_threads()} threads"


def _time_backend(operands: list[tuple], backend: str) -> float:
    """Seconds of one weighted pass over ``operands`` (forward, input- and weight-gradient products) on
    ``backend``."""
    total = 0.0
    for x, w, g, count in operands:
        best = float("inf")
        for _ in range(REPEATS):
            t0 = time.perf_counter()
            mm_nt(x, w, backend)  # forward: (rows, in) @ (out, in).T
            mm_nn(g, w, backend)  # input gradient: (rows, out) @ (out, in)
            weight_grad(g, x, backend)  # weight gradient: (out, rows) @ (rows, in), as training computes it
            best = min(best, time.perf_counter() - t0)
        total += count * best
    return total


def probe_matmul(shapes: Counter, rows: int, rounds: int = 2) -> MatmulChoice:
    """Time ATen and oneDNN on ``shapes`` (``linear_shapes``) with ``rows`` rows and choose (no cache)."""
    rows = max(1, min(rows, MAX_ROWS))
    gen = torch.Generator().manual_seed(0)  # the probe does not move the global RNG (runs stay reproducible)
    operands = [(torch.randn(rows, i, generator=gen), torch.randn(o, i, generator=gen),
                 torch.randn(rows, o, generator=gen), n) for (i, o), n in sorted(shapes.items())]
    best = {"aten": float("inf"), "onednn": float("inf")}
    for backend in ("aten", "onednn"):  # warm-up: oneDNN JIT-compiles its kernels on first use
        _time_backend(operands, backend)
    for _ in range(rounds):
        for backend in ("aten", "onednn", "onednn", "aten"):
            best[backend] = min(best[backend], _time_backend(operands, backend))
    backend = "onednn" if best["aten"] >= ONEDNN_MARGIN * best["onednn"] else "aten"
    return MatmulChoice(backend, best["aten"], best["onednn"], rows)


def choose_matmul(model: nn.Module, rows: int) -> MatmulChoice:
    """The faster GEMM backend for training ``model`` on ``rows`` tokens per micro-batch on this CPU:
    the cached choice of this machine and shape, else ``probe_matmul`` (then cached)."""
    shapes = linear_shapes(model)
    if not shapes:
        return MatmulChoice("aten", 0.0, 0.0, rows, cached=False)
    layout = " ".join(f"{i}x{o}:{n}" for (i, o), n in sorted(shapes.items()))
    key = f"probe v{PROBE_VERSION} | {machine_key()} | rows {min(rows, MAX_ROWS)} | {layout}"

    def probe() -> dict:
        return {k: v for k, v in asdict(probe_matmul(shapes, rows)).items() if k != "cached"}

    found, cached = cached_json(CACHE_KIND, key, probe,
                                valid=lambda v: isinstance(v, dict) and v.get("backend") in ("aten", "onednn"))
    return MatmulChoice(found["backend"], float(found.get("aten_s", 0.0)), float(found.get("onednn_s", 0.0)),
                        int(found.get("rows", rows)), cached=cached)


def apply_training_matmul(model: nn.Module, name: str, device: torch.device | str, dtype: str, rows: int) -> str:
    """``run.matmul=name`` applied to ``model`` (``use_matmul_backend``) for training on ``rows`` tokens per
    micro-batch; returns the backend in use. ``auto`` on a CPU in fp32 with oneDNN is ``choose_matmul``'s
    pick; everything else resolves as ``stemlm.runtime.matmul.resolve_matmul_backend`` says."""
    backend = resolve_matmul_backend(name, device, dtype)
    if name == "auto" and backend == "onednn":
        backend = choose_matmul(model, rows).backend
    use_matmul_backend(model, backend)
    return backend
