"""Keep freed CPU memory in the process heap instead of handing it back to the OS each step.

A CPU training step allocates and frees the same large activations and gradients every time.
glibc's malloc serves blocks above its mmap threshold (128 KiB, raised on its own up to 32 MiB)
with fresh ``mmap`` calls and returns freed memory at the top of the heap once more than the trim
threshold is free, so the next step faults new pages in. Raising both thresholds keeps the
memory mapped, much as PyTorch's CUDA caching allocator does on GPUs; the cost is that resident
memory stays at its peak. Measured page faults and step times: docs/training.md
("Freed memory stays mapped").

The settings are process-wide (they also speed up any other model trained in the same process)
and only exist on glibc; elsewhere ``keep_freed_memory`` does nothing and says so.
"""

from __future__ import annotations

import ctypes
import platform

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt parameter numbers (malloc.h)
MMAP_THRESHOLD = 64 << 20  # blocks above this still get their own mapping
TRIM_THRESHOLD = 1 << 30  # free memory kept at the top of the heap

_applied = False


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds (see the module docstring); returns whether they are
    in effect (False on other C libraries, or if ``mallopt`` refused). Idempotent."""
    global _applied
    if _applied:
        return True
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    _applied = bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    return _applied
