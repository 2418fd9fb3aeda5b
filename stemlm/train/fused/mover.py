"""Copies between host RAM and the compute device on a side stream (CUDA), or plain copies (CPU).

The host tier's pipeline (``host.py``) is written once against this: on CUDA the host buffers
are pinned, host -> device and device -> host copies run on a side stream and are ordered with
events (the compute stream waits on an event, never the host); on the CPU every copy is a
synchronous ``clone`` into separate memory, so the same code runs and is tested without a GPU.
``gather_views``/``scatter_views`` let the device itself read and write host RAM through views of it
(``stemlm.runtime.uva``) instead: no host gather, no staging buffer, no host wait.
"""

from __future__ import annotations

import torch


def to_device_async(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device`` without the host waiting: a host tensor is pinned first (a copy from
    pageable memory would wait for the device's queue to drain)."""
    device = torch.device(device)
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


class Mover:
    """Asynchronous copies for one compute ``device``."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None

    def host_empty(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """A host buffer that can be copied asynchronously (pinned on CUDA)."""
        return torch.empty(shape, dtype=dtype, pin_memory=self.cuda)

    def to_device(self, host: list[torch.Tensor]) -> tuple[list[torch.Tensor], object]:
        """Start copying ``host`` tensors to the device; ``(device tensors, event)``; call ``ready``
        before the compute stream reads them. The host tensors must stay alive until then."""
        if not self.cuda:
            return [t.clone() for t in host], None
        with torch.cuda.stream(self.stream):
            out = [t.to(self.device, non_blocking=True) for t in host]
            event = torch.cuda.Event()
            event.record(self.stream)
        return out, event

    def ready(self, tensors: list[torch.Tensor], event) -> None:
        """Make the compute stream wait for a ``to_device`` copy (no host wait)."""
        if event is None:
            return
        main = torch.cuda.current_stream(self.device)
        main.wait_event(event)
        for t in tensors:
            t.record_stream(main)  # allocated on the side stream, used on the compute stream

    def to_host(self, tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], object]:
        """Start copying device ``tensors`` (after the work queued so far) to host buffers;
        ``(host tensors, event)``: read them after ``wait``."""
        if not self.cuda:
            return [t.clone() for t in tensors], None
        main = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(main)
        with torch.cuda.stream(self.stream):
            host = [self.host_empty(t.shape, t.dtype) for t in tensors]
            for h, t in zip(host, tensors):
                h.copy_(t, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        for t in tensors:
            t.record_stream(self.stream)
        return host, event

    def gather_views(self, views: list[torch.Tensor], ids: torch.Tensor) -> tuple[list[torch.Tensor], object]:
        """Rows ``ids`` (host, along dim 1) of host tensors the device reads in place (``runtime.uva``),
        gathered by the device itself on the side stream: ``(device tensors, event)``, as ``to_device``."""
        if not self.cuda:
            return [v.index_select(1, ids) for v in views], None
        with torch.cuda.stream(self.stream):
            idx = ids.pin_memory().to(self.device, non_blocking=True)
            out = [v.index_select(1, idx) for v in views]  # (n, F, ...) each, read across the bus
            event = torch.cuda.Event()
            event.record(self.stream)
        return out, event

    def scatter_views(self, views: list[torch.Tensor], ids: torch.Tensor, rows: list[torch.Tensor]) -> object:
        """Write device ``rows`` into host tensors the device writes in place, at ``ids`` (host, along
        dim 1), on the side stream after the work queued so far; returns an event (None on the CPU)."""
        if not self.cuda:
            for v, r in zip(views, rows):
                v.index_copy_(1, ids, r)
            return None
        main = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(main)
        with torch.cuda.stream(self.stream):
            idx = ids.pin_memory().to(self.device, non_blocking=True)
            for v, r in zip(views, rows):
                v.index_copy_(1, idx, r)
            event = torch.cuda.Event()
            event.record(self.stream)
        for r in rows:
            r.record_stream(self.stream)
        return event

    @staticmethod
    def wait(event) -> None:
        """Block the host until a ``to_host`` copy has landed."""
        if event is not None:
            event.synchronize()
