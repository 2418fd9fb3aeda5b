"""Background gathering of table rows, issued as soon as the token ids of a forward pass are known.

The prefetcher belongs to a ``TableStore``. ``Prefetcher.prefetch(ids)`` deduplicates the ids
once, hands one job to a single worker thread, which gathers the rows of every table layer in
layer order (through each table's cache, under the store's lock) and publishes them layer by
layer, and returns the job. ``TableStore.prefetch(ids)`` hands the caller that job as a ticket (a
``LayerRows``) which the caller passes to the forward of those ids (``model(ids,
table_rows=ticket)``): nothing is matched after the fact. Each layer ``wait``s for its own rows
when the model reaches it: if the worker has not finished that layer yet the forward waits, and
the wait is counted as a stall. A forward given no ticket gathers synchronously, so issuing a
prefetch never changes results, only timing.

On CUDA the worker runs on a side stream: rows go through pinned staging memory and are copied
with ``non_blocking=True``; each layer records an event the consuming stream waits on (no CPU
wait). This path is written for CUDA but exercised only on CPU here; the CPU thread path is the
tested fallback.

A write (``write_rows``) after a prefetch was issued makes that table's prefetched rows stale
(the job remembers each table's ``version``); the forward then gathers that layer again. A new
``prefetch`` cancels the layers of the previous job that the worker has not started.

Read-ahead (disk tier): before gathering a layer, the worker tells the kernel the rows of the
next ``READ_AHEAD_LAYERS`` layers (``advise``: ``POSIX_FADV_WILLNEED``), so the device serves
those reads in parallel instead of one ``pread`` at a time (what it gained, measured, is in
docs/offload.md). ``read_ahead = False`` turns it off.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from ..model.tables import check_ids, unique_ids
from ..runtime.threads import single_threaded_worker

READ_AHEAD_LAYERS = 3  # layers hinted beyond the one being gathered


@dataclass
class Job:
    """One prefetch: its unique ids and inverse, and one future per layer."""

    shape: torch.Size  # of the ids the rows belong to
    uniq: torch.Tensor
    inverse: torch.Tensor
    futures: dict[str, Future]  # layer key -> (rows, event); never mutated after creation
    versions: dict[str, int]  # layer key -> the table's version when the job was issued
    taken: set = field(default_factory=set)  # layer keys already consumed
    main_stream: object = None


class Prefetcher:
    """One worker thread gathering the rows of ``tables`` (layer key -> table, in layer order)
    ahead of the forward that uses them."""

    def __init__(self, tables: dict, device=None):
        self.tables = dict(tables)
        self.device = torch.device(device or "cpu")
        self.num_rows = next(iter(self.tables.values())).num_rows if self.tables else 0
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stemlm-prefetch")
        if self.device.type == "cpu":  # the compute is on these cores too: no OpenMP team of the worker's own
            single_threaded_worker(self._pool)
        self.read_ahead = True  # hint disk reads before gathering (see the module docstring)
        self._jobs = threading.Lock()  # guards the current job, not rows (the tables' lock does)
        self._job: Job | None = None
        cuda = self.device.type == "cuda" and torch.cuda.is_available()
        self._stream = torch.cuda.Stream(self.device) if cuda else None

    def prefetch(self, ids: torch.Tensor) -> Job:
        """Start gathering the rows of ``ids`` for every table; returns the job at once."""
        check_ids(ids, self.num_rows)
        uniq, inverse = unique_ids(ids)
        job = Job(ids.shape, uniq, inverse, {k: Future() for k in self.tables},
                  {k: t.version for k, t in self.tables.items()})
        if self._stream is not None:
            job.main_stream = torch.cuda.current_stream(self.device)
        with self._jobs:
            old, self._job = self._job, job
        if old is not None:
            for fut in old.futures.values():
                fut.cancel()  # layers the worker has not started are skipped
        self._pool.submit(self._run, job)
        return job

    def _run(self, job: Job) -> None:
        try:
            if self._stream is not None:
                self._stream.wait_stream(job.main_stream)  # see writes queued on the main stream
            k = READ_AHEAD_LAYERS
            keys = list(self.tables)
            for i, key in enumerate(keys):
                if self.read_ahead:  # keep the reads of this layer and the next k queued with the device
                    for ahead in keys[:k + 1] if i == 0 else keys[i + k:i + k + 1]:
                        if not job.futures[ahead].cancelled():
                            self.tables[ahead].advise(job.uniq)
                fut = job.futures[key]
                if fut.set_running_or_notify_cancel():
                    self._gather_into(fut, self.tables[key], job.uniq)
        except BaseException as e:  # never leave a lookup waiting for a layer that will not come
            for fut in job.futures.values():
                if not fut.done():
                    fut.set_exception(e)

    def _gather_into(self, fut: Future, table, uniq: torch.Tensor) -> None:
        try:
            if self._stream is None:
                fut.set_result((table.fetch(uniq), None))
                return
            with torch.cuda.stream(self._stream):
                rows = table.fetch(uniq)
                event = torch.cuda.Event()
                event.record(self._stream)
            fut.set_result((rows, event))
        except BaseException as e:  # re-raised in the forward that takes this layer
            fut.set_exception(e)

    def wait(self, job: Job, key: str) -> tuple[torch.Tensor, float | None] | None:
        """``(rows, seconds waited or None)`` of layer ``key`` of ``job``; None when that layer was
        taken already, cancelled, or made stale by a write (the caller then gathers it)."""
        with self._jobs:
            if key in job.taken or self.tables[key].version != job.versions[key]:
                return None
            job.taken.add(key)
        fut = job.futures[key]
        stalled, t0 = not fut.done(), time.perf_counter()
        try:
            rows, event = fut.result()
        except CancelledError:
            return None
        if event is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(event)
            rows.record_stream(current)
        return rows, (time.perf_counter() - t0) if stalled else None

    def close(self) -> None:
        """Finish pending work and stop the worker."""
        self._pool.shutdown(wait=True)
