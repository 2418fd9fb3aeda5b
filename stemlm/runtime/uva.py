"""Host rows the accelerator reads itself: a CUDA view of pinned host memory (unified virtual addressing).

On a 64-bit CUDA system, memory pinned by CUDA (``tensor.pin_memory()``) has the same address on the
host and on the device, so a kernel can read and write it directly across the bus, with no CPU gather
and no copy launched by the host (vLLM's ``get_cuda_view_from_cpu_tensor`` does the same in C++).
Stock torch builds such a view from any object exposing ``__cuda_array_interface__``:
``torch.as_tensor(obj, device="cuda")`` wraps the pointer without copying. ``index_select`` on the
view gathers rows from host RAM inside a kernel (and inside a captured CUDA graph); ``index_copy_``
writes them back; writes the host makes later are seen by the next kernel.

``device_view(t, device)`` returns a tensor on ``device`` aliasing ``t``'s memory: ``t`` itself when
the device is the CPU (there the host *is* the device, so the same code runs in the tests), the UVA
view on CUDA when ``t`` is pinned, else None (the caller keeps its copying path).
"""

from __future__ import annotations

import torch

# __cuda_array_interface__ type strings; bf16 has none in numpy's notation: it travels as int16 and is viewed back
_TYPESTR = {torch.float32: "<f4", torch.float16: "<f2", torch.int16: "<i2", torch.int8: "|i1", torch.uint8: "|u1",
            torch.int32: "<i4", torch.int64: "<i8", torch.float64: "<f8"}


class _CudaArray:
    """The ``__cuda_array_interface__`` (version 3) of a contiguous pinned host tensor."""

    def __init__(self, t: torch.Tensor):
        self.__cuda_array_interface__ = {"shape": tuple(t.shape), "typestr": _TYPESTR[t.dtype],
                                         "data": (t.data_ptr(), False), "version": 3, "strides": None}


def device_view(t: torch.Tensor, device: torch.device | str) -> torch.Tensor | None:
    """A tensor on ``device`` sharing ``t``'s host memory (see the module docstring), or None."""
    device = torch.device(device)
    if device.type == "cpu":
        return t if t.device.type == "cpu" else None
    if device.type != "cuda" or t.device.type != "cpu" or not t.is_contiguous() or not t.is_pinned():
        return None
    raw = t.view(torch.int16) if t.dtype == torch.bfloat16 else t
    if raw.dtype not in _TYPESTR:
        return None
    try:
        view = torch.as_tensor(_CudaArray(raw), device=device)
    except (RuntimeError, TypeError, ValueError):
        return None
    view = view.view(torch.bfloat16) if t.dtype == torch.bfloat16 else view
    view._host_owner = t  # keep the host memory alive as long as the view
    return view
