"""Which threads run torch's parallel CPU work: one per process, the others alone.

torch's CPU operators split their work over an OpenMP team that belongs to the thread that calls them.
Every thread that runs one parallel operator keeps a team (its helper threads stay docked after the
operator ends), and once a process has more OpenMP threads than CPUs, GNU OpenMP stops spinning
between parallel regions: every region then wakes its helpers through the kernel. On 2 cores, a decode
step of the tiny preset with tables in host RAM took 2.2x longer (batch 16: 11.1 against 5.1 ms) only
because the table prefetcher's worker had run one ``index_select`` with a team of its own; a second
thread decoding after the main thread had loaded the model was as slow (batch 4: 6.5 against 2.9 ms).

So: the thread that loads a model runs its forwards too (``stemlm serve`` runs its engine on the main
thread, as a task of uvicorn's event loop: ``Engine.run_async``), and helper threads that touch tensors
(the prefetcher's worker) run their operators on themselves alone (``single_threaded_worker``).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch


def _alone() -> None:
    torch.get_num_threads()  # torch's per-thread setup first, which would otherwise undo the next line
    torch.set_num_threads(1)


def single_threaded_worker(pool: ThreadPoolExecutor) -> None:
    """Make the one worker thread of ``pool`` run torch's CPU operators on itself alone (no OpenMP team).

    ``torch.set_num_threads`` also sets the count that threads started later take: it is put back to the
    calling thread's own count at once, so only the worker runs alone."""
    keep = torch.get_num_threads()
    pool.submit(_alone).result()
    torch.set_num_threads(keep)
