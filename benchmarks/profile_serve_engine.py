"""Where the serving engine's own overhead goes: every prefill group and decode step, engine against direct.

``bench_serve.py`` splits the server's overhead into continuous batching (direct ÷ engine) and HTTP (engine ÷
served). This script looks inside the first share: on ``bench_serve.py``'s model and workload (tiny STEM-1/3,
host tables, C closed-loop clients × 8 requests × 32 tokens, prompt lengths mixed), it runs the engine as
``stemlm serve`` does (a task of an event loop on the main thread, ``Engine.run_async``) with C client threads
submitting requests one after another, then the same requests through ``generate_batch`` in lockstep batches of
C on the same thread, and times every ``DecodeCore.add`` (a prefill group) and ``DecodeCore.step``: how many
groups, their sizes, the rows a step decodes, the seconds of each; a step that takes newcomers into its forward
(``DecodeCore.step(join=...)``, the engine's merged prefill) counts as a step and as a merged group. It then times
adding one prompt of 8, 32 and 64 tokens to a running batch of 15 rows (``add``) against the next decode step,
and the same prompt merged into the step (one forward for both).

    python benchmarks/profile_serve_engine.py              # C = 16, 3 rounds (~1 min)
    python benchmarks/profile_serve_engine.py --quick      # C = 2, 1 round, 2 requests of 4 tokens
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import torch
from _store_bench import stem_bench_model
from _train_bench import write_result
from bench_serve import direct_phase, engine_phase, workload

from stemlm.inference import core as core_mod
from stemlm.inference.core import DecodeCore, Generation
from stemlm.inference.sampling import SamplingParams
from stemlm.serve.engine import Engine
from stemlm.store import Placement, open_model


class Recorder:
    """Wraps ``DecodeCore.add`` and ``step`` (the class's, so every core the engine makes is timed):
    ``(kind, rows, seconds, joined)`` per call, ``rows`` = the group's prompts for ``add``, the batch for ``step``,
    ``joined`` the newcomers a step prefilled in its forward."""

    def __init__(self):
        self.calls: list[tuple[str, int, float]] = []
        self._add, self._step = DecodeCore.add, DecodeCore.step
        rec = self

        def add(core, seqs):
            t = time.perf_counter()
            out = rec._add(core, seqs)
            rec.calls.append(("add", len(seqs), time.perf_counter() - t, 0))
            return out

        def step(core, join=()):
            n, t = len(core.running), time.perf_counter()
            out = rec._step(core, join)
            rec.calls.append(("step", n, time.perf_counter() - t, len(join)))
            return out
        core_mod.DecodeCore.add, core_mod.DecodeCore.step = add, step

    def take(self, wall: float) -> dict:
        """The calls since the last ``take`` summed up, for a phase of ``wall`` seconds."""
        calls, self.calls = self.calls, []
        adds = [c for c in calls if c[0] == "add"]
        steps = [c for c in calls if c[0] == "step"]
        merged = [c for c in steps if c[3]]
        return {"wall_s": wall, "prefill_groups": len(adds), "group_sizes": [c[1] for c in adds],
                "merged_groups": len(merged), "merged_sizes": [c[3] for c in merged],
                "prefill_s": sum(c[2] for c in adds), "steps": len(steps), "steps_s": sum(c[2] for c in steps),
                "step_median_ms": 1e3 * statistics.median(c[2] for c in steps) if steps else None,
                "rows_per_step": statistics.mean(c[1] for c in steps) if steps else None,
                "outside_core_s": wall - sum(c[2] for c in calls)}

    def restore(self) -> None:
        core_mod.DecodeCore.add, core_mod.DecodeCore.step = self._add, self._step


def phases(engine: Engine, rec: Recorder, work, max_tokens: int, rounds: int) -> list[dict]:
    """``rounds`` of (engine phase, direct phase), the engine a task of this thread's event loop."""
    out = []

    def drive():
        for _ in range(rounds):
            rec.calls.clear()
            t = time.perf_counter()
            engine_phase(engine, work, max_tokens)
            e = rec.take(time.perf_counter() - t)
            t = time.perf_counter()
            engine.call(lambda: direct_phase(engine.model, work, max_tokens, engine.eos_ids))
            d = rec.take(time.perf_counter() - t)
            out.append({"engine": e, "direct": d})
            print(f"engine: {e['prefill_groups']} groups {e['prefill_s']:.3f} s + {e['merged_groups']} merged, "
                  f"{e['steps']} steps {e['steps_s']:.3f} s "
                  f"({e['rows_per_step']:.2f} rows); direct: {d['prefill_groups']} groups {d['prefill_s']:.3f} s, "
                  f"{d['steps']} steps {d['steps_s']:.3f} s ({d['rows_per_step']:.2f} rows)", flush=True)
        engine.shutdown(drain=True)

    async def main():
        task = asyncio.ensure_future(engine.run_async())
        await asyncio.to_thread(drive)
        await task

    asyncio.run(main())
    return out


def add_cost(model, vocab: int, lengths: list[int], repeats: int) -> dict:
    """Median ms of adding one prompt of each length to a running batch of 15 rows, of the next step, and of the
    step with the prompt merged into it."""
    g = torch.Generator().manual_seed(0)

    def gen(n: int, seed: int) -> Generation:
        ids = torch.randint(0, vocab, (n,), generator=g).tolist()
        return Generation(ids, SamplingParams(1000, temperature=1.0, seed=seed))

    core = DecodeCore(model, [], 0, model.tables, 17, None, "auto")
    core.add([gen(n, i) for i, n in enumerate([8, 32, 16, 64, 24, 48, 12, 40, 8, 32, 16, 64, 24, 48, 12])])
    for _ in range(5):
        core.step()
    times: dict[int, list[tuple[float, float, float]]] = {n: [] for n in lengths}
    for r in range(repeats):
        for n in lengths:
            s = gen(n, 100 + r)
            t = time.perf_counter()
            core.add([s])
            t_add = time.perf_counter() - t
            t = time.perf_counter()
            core.step()
            t_step = time.perf_counter() - t
            core.drop([s])  # back to 15 rows
            s = gen(n, 200 + r)
            t = time.perf_counter()
            core.step(join=[s])
            times[n].append((t_add, t_step, time.perf_counter() - t))
            core.drop([s])
    return {str(n): {"add_ms": 1e3 * statistics.median(a for a, _, _ in v),
                     "step_ms": 1e3 * statistics.median(b for _, b, _ in v),
                     "merged_step_ms": 1e3 * statistics.median(c for _, _, c in v)} for n, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=16, help="concurrent closed-loop clients C (default 16)")
    ap.add_argument("--requests", type=int, default=8, help="requests per client (default 8)")
    ap.add_argument("--max-tokens", type=int, default=32, help="tokens generated per request (default 32)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of engine and direct phases (default 3)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    ap.add_argument("--seed", type=int, default=0, help="seed of weights, prompts and sampling (default 0)")
    ap.add_argument("--quick", action="store_true", help="C = 2, 2 requests of 4 tokens, 1 round; writes "
                                                         "engine_profile.quick.json")
    args = ap.parse_args()
    if args.quick:
        args.clients, args.requests, args.max_tokens, args.rounds = 2, 2, 4, 1
    args.preset, args.stem_layers = "tiny", "1/3"
    cfg, ckpt, tables = stem_bench_model(args, "serve")
    model = open_model(ckpt, Placement("host", tables_file=tables))
    lens = [8, 32, 16, 64, 24, 48, 12, 40]
    work = workload(args.clients, args.requests, lens, cfg.vocab_size, args.seed)
    rec = Recorder()
    try:
        rounds = phases(Engine(model, max_batch=16, store=model.tables), rec, work, args.max_tokens, args.rounds)
    finally:
        rec.restore()
    cost = add_cost(model, cfg.vocab_size, [8, 32, 64], 2 if args.quick else 6)
    for n, v in cost.items():
        print(f"add one prompt of {n} tokens to 15 rows: {v['add_ms']:.2f} ms; the next step {v['step_ms']:.2f} ms; "
              f"merged into the step: {v['merged_step_ms']:.2f} ms")
    path = write_result("engine_profile", args.quick, {
        "config": {"preset": "tiny", "stem_layers": "1/3", "tier": "host", "clients": args.clients,
                   "requests_per_client": args.requests, "max_tokens": args.max_tokens, "prompt_lens": lens,
                   "rounds": args.rounds, "engine": "Engine.run_async on the main thread's event loop, client threads"},
        "rounds": rounds, "add_one_prompt_to_15_rows": cost})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
