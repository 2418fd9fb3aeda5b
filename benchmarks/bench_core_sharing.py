"""What other work on the machine costs the decode engine: a Python thread in its process versus a process of its own.

``stemlm serve`` runs the engine on the main thread and HTTP on a thread of the same process (issue 35 asked whether
the engine would be better off in its own process, away from the HTTP interpreter's lock). On a CPU the engine's
decode step is one OpenMP team using every core, so anything else that runs takes cores from it; this script measures
whether *where* that other work runs matters.

The engine side: the tiny preset with STEM in every third layer, tables on the host tier (the model ``bench_serve.py``
serves), a running batch of 16 mixed-length prompts, ``--steps`` decode steps timed. Beside it, one of:

* ``alone``: nothing;
* ``thread``: a Python thread of this process that spins ``--busy-ms`` and sleeps ``--period-ms``, over and over
  (it holds the interpreter lock while it spins, as an HTTP handler does while it parses a request);
* ``process``: the same loop in a separate process (what an engine process would compete with: the HTTP process);
* ``idle_process``: that process with no spin at all (only its wake-ups).

Rounds interleave the four (order rotated); the ratio of each to ``alone`` in the same round, median over rounds, is
the slowdown. The busy share of one core (``busy / (busy + period)``) is printed beside it.

    python benchmarks/bench_core_sharing.py            # 5 rounds, 1 ms busy every 10 ms
    python benchmarks/bench_core_sharing.py --quick    # 1 round, few steps
"""

from __future__ import annotations

import argparse
import multiprocessing
import threading
import time

import torch
from _store_bench import stem_bench_model
from _train_bench import paired_ratio, rotated, round_ratios, write_result

from stemlm.inference.core import DecodeCore, Generation
from stemlm.inference.sampling import SamplingParams
from stemlm.store import Placement, open_model

PROMPT_LENS = [8, 32, 16, 64, 24, 48, 12, 40] * 2


def spin_and_sleep(stop, busy_s: float, period_s: float, ready=None) -> None:
    """Spin ``busy_s`` (pure Python: holds the interpreter lock) then sleep ``period_s``, until ``stop`` is set."""
    if ready is not None:
        ready.set()
    while not stop.is_set():
        t = time.perf_counter()
        while time.perf_counter() - t < busy_s:
            pass
        time.sleep(period_s)


def step_ms(model, vocab: int, steps: int, seed: int) -> float:
    """Mean milliseconds of one decode step of a running batch of 16 prompts (``PROMPT_LENS``); every row stays
    in the batch for all ``steps`` (the longest prompt plus ``steps`` must fit the model's context)."""
    room = model.cfg.max_seq_len - max(PROMPT_LENS)
    if steps > room:
        raise SystemExit(f"--steps {steps}: the {max(PROMPT_LENS)}-token prompt would pass max_seq_len="
                         f"{model.cfg.max_seq_len} and leave the batch; use at most {room}")
    g = torch.Generator().manual_seed(seed)
    core = DecodeCore(model, [], 0, "auto", len(PROMPT_LENS))
    core.add([Generation(torch.randint(0, vocab, (n,), generator=g).tolist(), SamplingParams(steps + 1, seed=seed + j))
              for j, n in enumerate(PROMPT_LENS)])
    t0 = time.perf_counter()
    for _ in range(steps):
        core.step()
    return (time.perf_counter() - t0) / steps * 1e3


class Beside:
    """The other work of one setting, running for the duration of a ``with`` block."""

    def __init__(self, kind: str, busy_s: float, period_s: float):
        self.kind, self.busy_s, self.period_s = kind, busy_s, period_s

    def __enter__(self):
        if self.kind == "thread":
            self.stop = threading.Event()
            self.worker = threading.Thread(target=spin_and_sleep, args=(self.stop, self.busy_s, self.period_s), daemon=True)
            self.worker.start()
        elif self.kind in ("process", "idle_process"):
            ctx = multiprocessing.get_context("spawn")
            self.stop, ready = ctx.Event(), ctx.Event()
            busy = self.busy_s if self.kind == "process" else 0.0
            self.worker = ctx.Process(target=spin_and_sleep, args=(self.stop, busy, self.period_s, ready), daemon=True)
            self.worker.start()
            ready.wait()  # the child has imported what it needs: its start-up is not timed
            time.sleep(0.3)
        return self

    def __exit__(self, *exc):
        if self.kind != "alone":
            self.stop.set()
            self.worker.join()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny", help="model shape (default tiny)")
    ap.add_argument("--stem-layers", default="1/3", help="STEM placement (default 1/3)")
    ap.add_argument("--steps", type=int, default=160, help="decode steps timed per setting and round (default 160; "
                    "at most the context less the longest prompt)")
    ap.add_argument("--rounds", type=int, default=5, help="rounds over the settings (default 5)")
    ap.add_argument("--busy-ms", type=float, default=1.0, help="the other work's spin per cycle (default 1 ms)")
    ap.add_argument("--period-ms", type=float, default=10.0, help="its sleep per cycle (default 10 ms)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    ap.add_argument("--quick", action="store_true", help="1 round of 20 steps; writes core_sharing.quick.json")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.steps = 1, 20
    cfg, ckpt, tables = stem_bench_model(args, "serve")
    model = open_model(ckpt, Placement("host", tables_file=tables))
    busy, period = args.busy_ms / 1e3, args.period_ms / 1e3
    kinds = ["alone", "thread", "process", "idle_process"]
    step_ms(model, cfg.vocab_size, 10, 0)  # warm-up
    times: dict[str, list[float]] = {k: [] for k in kinds}
    for r in range(args.rounds):
        for kind in rotated(kinds, r):
            with Beside(kind, busy, period):
                times[kind].append(step_ms(model, cfg.vocab_size, args.steps, r))
        print(f"round {r + 1}: " + ", ".join(f"{k} {times[k][-1]:.2f} ms" for k in kinds), flush=True)
    share = busy / (busy + period)
    slowdown = {k: paired_ratio(times[k], times["alone"]) - 1 for k in kinds[1:]}
    print(f"the other work's share of one core: {100 * share:.1f} %")
    for k, v in slowdown.items():
        print(f"{k:>12}: decode step {100 * v:+.1f} % against alone (rounds "
              f"{', '.join(f'{100 * (x - 1):+.1f}' for x in round_ratios(times[k], times['alone']))})")
    path = write_result("core_sharing", args.quick, {
        "config": {"preset": args.preset, "stem_layers": args.stem_layers, "tier": "host", "batch": len(PROMPT_LENS),
                   "steps": args.steps, "rounds": args.rounds, "busy_ms": args.busy_ms, "period_ms": args.period_ms},
        "busy_share_of_one_core": share, "step_ms": times, "slowdown": slowdown,
        "slowdown_rounds": {k: [x - 1 for x in round_ratios(times[k], times["alone"])] for k in kinds[1:]}})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
