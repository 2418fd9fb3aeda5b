"""Device names given by users (``--device``, ``run.device``): parsed and checked before any work."""

from __future__ import annotations

import torch


def resolve_device(name: str, option: str = "--device") -> torch.device:
    """The ``torch.device`` called ``name`` (``auto`` = the GPU if there is one, else the CPU).

    An unknown name, or a device this machine does not have, is a ``ValueError`` naming
    ``option``, the value and what is available, instead of a failure deep inside torch.
    """
    name = str(name).strip()
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise ValueError(f"{option}: unknown device {name!r}; use {available_devices()}") from None
    if device.type == "cpu":
        return device
    backend = getattr(torch, device.type, None)
    count_fn = getattr(backend, "device_count", None)
    available = getattr(backend, "is_available", None)
    if available is None or not available():
        raise ValueError(f"{option}: device {name!r} is not available on this machine; use {available_devices()}")
    if device.index is not None and count_fn is not None and device.index >= count_fn():
        raise ValueError(f"{option}: device {name!r} does not exist: this machine has {count_fn()} {device.type} "
                         f"device(s); use {available_devices()}")
    return device


def available_devices() -> str:
    """The devices of this machine, as a user would name them (for error messages and help)."""
    names = ["auto", "cpu"]
    if torch.cuda.is_available():
        names += ["cuda"] + [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        names.append("mps")
    return " | ".join(names)
