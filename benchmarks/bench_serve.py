"""stemlm serve under load: latency, throughput and overhead against direct batched generation.

The model is the tiny preset with STEM in every third layer and random weights, tables on the
host tier (``_store_bench.bench_checkpoint``; a small BPE tokenizer is trained for the server's
text side, the prompts are token ids). The server runs in this process as ``stemlm serve`` runs it
(``run_served``): uvicorn and the engine share the main thread, which loaded the model, the engine a task
of the event loop that steps between HTTP's work (``--max-batch`` 16); direct generation runs on that
thread too (``Engine.call``), so that one OpenMP team does all the model's work, as in the server
(``stemlm.runtime.threads``). The load comes from a separate process, as a server's clients would (in this
process the clients' Python would compete with the engine for the interpreter lock): for each
concurrency C (1, 2, 4, 8, 16), C client threads there each send ``--requests`` non-streaming
completions, one after another, as plain JSON POSTs on a kept-alive connection (``--client raw``,
the default: ~0.2 ms of CPU a request, which the clients take from the server's two cores) or through
the ``openai`` client (``--client openai``: ~2-3 ms a request); each request has its own prompt
(mixed lengths) and seed (temperature 1.0).

Measured per C: p50/p95 request latency, generated tokens/s over the wall time of the phase,
requests lost (errors; must be 0) and requests whose token count differs from direct generation
(same seeds, so 0 expected), and the same
prompts decoded directly with ``generate_batch`` in batches of C on the same model (while the
server is idle), side by side in the same round. Each direct batch mixes prompt lengths as the
server's batches do (``workload``; ``--aligned-lengths`` gives the earlier workload, whose direct
batches each held one length). Overhead = direct tokens/s ÷ served tokens/s − 1
(median over rounds of the per-round value). Goal: overhead <= 10 %. Because the wall time of a
phase moves with whatever else the machine runs, each round also records the CPU seconds per
generated token of each side (the server process and its clients' process for the served phase,
this process for the others): ``cpu_overhead`` = served ÷ direct − 1, ``cpu_overhead_of_http`` =
served ÷ engine − 1. CPU time is not stolen by other processes' load, so it shows the server's
extra work with less noise (idle OpenMP threads spinning count as work, which inflates it a little).

To say where an overhead comes from, each round also runs the same closed-loop workload on the
server's engine without HTTP (C threads of this process submitting engine requests one after another):
direct ÷ engine is the cost of continuous batching itself (requests joining and leaving a running
batch), engine ÷ served the cost of the HTTP layer, including the CPU the load-generating clients take
from the same machine (reported as ``client_cpu_share``: their CPU seconds ÷ wall time × cores). (Until
2026-11-29 HTTP ran on a thread of its own and the JSON also had its CPU a request, read per thread; on one
thread with the engine it is no longer told apart.) Both closed-loop phases also record the engine's decode steps and
their mean running rows (its ``/metrics`` counters ``decode_steps`` and ``decode_rows``): ``steps_served_over_engine``
above 1 means the served phase needed more steps, of fewer rows, for the same tokens, i.e. rows stood empty while a
finished request's answer and its client's next request crossed HTTP.

    python benchmarks/bench_serve.py              # the real run (lead)
    python benchmarks/bench_serve.py --quick      # concurrency 1 and 2, a few tokens
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path

import torch
from _store_bench import stem_bench_model
from _train_bench import paired_ratio, rotated, round_ratios, write_result

from stemlm.inference.batch_generate import SamplingParams, generate_batch
from stemlm.data.tokenizer import train_bpe
from stemlm.serve.engine import Finished, Request
from stemlm.serve.server import free_port, load_served, run_served, uvicorn_server
from stemlm.store import Placement

TEXTS = ["The capital of France is Paris. Once upon a time there was a cat that sat on the mat."] * 40


def workload(clients: int, per_client: int, lens: list[int], vocab: int, seed: int,
             aligned: bool = False) -> list[list[tuple]]:
    """Per client, its requests as ``(prompt ids, seed)``; the same for a given C in every round.

    Client ``c``'s request ``k`` has length ``lens[(c + k) % len(lens)]``, so the direct phase's batches
    (request ``k`` of every client) mix the lengths as the served traffic does. ``aligned``: length
    ``lens[(c·per_client + k) % len(lens)]``, the workload before 2026-11-28, whose direct batches held
    prompts of one length each (with 8 requests per client and 8 lengths) and so never padded, packed or
    decoded at ragged positions, unlike any server's batch."""
    out = []
    for c in range(clients):
        reqs = []
        for k in range(per_client):
            i = c * per_client + k
            n = lens[i % len(lens)] if aligned else lens[(c + k) % len(lens)]
            g = torch.Generator().manual_seed(seed + i)
            reqs.append((torch.randint(0, vocab, (n,), generator=g).tolist(), seed + i))
        out.append(reqs)
    return out


def _openai_completion(url: str, name: str):
    """``complete(prompt, seed, max_tokens) -> completion tokens`` through the ``openai`` client (one per thread)."""
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)

    def complete(prompt, seed, max_tokens):
        r = client.completions.create(model=name, prompt=prompt, max_tokens=max_tokens, temperature=1.0, seed=seed)
        return r.usage.completion_tokens
    return complete


def _raw_completion(url: str, name: str):
    """The same request as ``_openai_completion`` as a plain JSON POST on one kept-alive connection
    (``http.client``): a tenth of the client's CPU per request, so the load generator takes less of
    the machine it shares with the server."""
    import http.client
    from urllib.parse import urlsplit

    where = urlsplit(url)
    conn = http.client.HTTPConnection(where.hostname, where.port, timeout=600)

    def complete(prompt, seed, max_tokens):
        body = json.dumps({"model": name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 1.0, "seed": seed})
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        answer = json.loads(resp.read())
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {answer}")
        return answer["usage"]["completion_tokens"]
    return complete


CLIENTS = {"openai": _openai_completion, "raw": _raw_completion}


def served_phase(url: str, name: str, work: list[list[tuple]], max_tokens: int, client: str = "openai") -> dict:
    """All clients at once against the server at ``url``; latency of each request and generated tokens per
    request. Runs in the load-generating process; ``client``: ``openai`` or ``raw`` (``CLIENTS``)."""
    def run_client(reqs):
        complete = CLIENTS[client](url, name)
        done = []
        for prompt, seed in reqs:
            t0 = time.perf_counter()
            try:
                tokens = complete(prompt, seed, max_tokens)
                done.append((time.perf_counter() - t0, tokens))
            except Exception as e:  # a lost request is counted, not fatal
                done.append((time.perf_counter() - t0, None, repr(e)))
        return done

    t0, cpu0 = time.perf_counter(), time.process_time()
    with ThreadPoolExecutor(len(work)) as pool:
        results = [r for rs in pool.map(run_client, work) for r in rs]
    wall, client_cpu = time.perf_counter() - t0, time.process_time() - cpu0
    ok = [r for r in results if r[1] is not None]
    lat = sorted(r[0] for r in ok)
    tokens = sum(r[1] for r in ok)
    return {"wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall, "per_request_tokens": [r[1] for r in results],
            "client_cpu_s": client_cpu, "client_cpu_share": client_cpu / (wall * os.cpu_count()),
            "latency_p50_s": statistics.median(lat) if lat else None,
            "latency_p95_s": lat[min(len(lat) - 1, int(0.95 * len(lat)))] if lat else None,
            "errors": [r[2] for r in results if r[1] is None]}


def direct_phase(model, work: list[list[tuple]], max_tokens: int, eos_ids) -> dict:
    """The same requests through ``generate_batch`` in batches of C (request k of every client together)."""
    tokens, per_request = 0, {}
    t0 = time.perf_counter()
    for k in range(len(work[0])):
        batch = [reqs[k] for reqs in work]
        params = [SamplingParams(max_tokens, temperature=1.0, seed=seed) for _, seed in batch]
        out = generate_batch(model, [p for p, _ in batch], params, eos_id=None,
                             stop=lambda i, toks: toks[-1] in eos_ids)
        for c, toks in enumerate(out):
            per_request[(c, k)] = len(toks)
        tokens += sum(map(len, out))
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall,
            "per_request_tokens": [per_request[(c, k)] for c in range(len(work)) for k in range(len(work[0]))]}


def engine_phase(engine, work: list[list[tuple]], max_tokens: int) -> dict:
    """The same closed-loop clients as ``served_phase``, as threads submitting to the engine directly."""
    def run_client(reqs):
        tokens = []
        for prompt, seed in reqs:
            done, got = threading.Event(), []
            sink = lambda ev, got=got, done=done: (done.set() if isinstance(ev, Finished) else got.append(ev))  # noqa: E731
            engine.submit(Request(prompt, SamplingParams(max_tokens, temperature=1.0, seed=seed), sink))
            done.wait()
            tokens.append(len(got))
        return tokens

    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(work)) as pool:
        per_request = [n for ns in pool.map(run_client, work) for n in ns]
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "tokens": sum(per_request), "tokens_per_s": sum(per_request) / wall,
            "per_request_tokens": per_request}


def cpu_timed(phase) -> dict:
    """``phase()``'s result with ``cpu_s``: the CPU seconds this process (all its threads) spent in it."""
    t0 = time.process_time()
    out = phase()
    out["cpu_s"] = time.process_time() - t0
    return out


def with_occupancy(engine, phase) -> dict:
    """``phase()``'s result with the engine's decode steps during it (``decode_steps``) and their mean running
    rows (``rows_per_step``), read from its ``/metrics`` counters: the same tokens in more steps of fewer rows
    is time lost to requests arriving late, not to work done per token."""
    before = engine.metrics.snapshot()
    out = phase()
    after = engine.metrics.snapshot()
    steps = after["decode_steps"] - before["decode_steps"]
    out["decode_steps"] = steps
    out["rows_per_step"] = (after["decode_rows"] - before["decode_rows"]) / steps if steps else None
    return out


def _stack(choice: str) -> str:
    """The event loop and HTTP parser uvicorn runs with."""
    if choice == "asyncio":
        return "asyncio + h11"
    import importlib.util

    found = [m for m in ("uvloop", "httptools") if importlib.util.find_spec(m)]
    return " + ".join(found) if found else "asyncio + h11"


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny", help="model shape (default tiny)")
    ap.add_argument("--stem-layers", default="1/3", help="STEM placement (default 1/3)")
    ap.add_argument("--concurrency", default="1,2,4,8,16", help="client counts (default 1,2,4,8,16)")
    ap.add_argument("--requests", type=int, default=8, help="requests per client (default 8)")
    ap.add_argument("--max-tokens", type=int, default=32, help="tokens generated per request (default 32)")
    ap.add_argument("--prompt-lens", default="8,32,16,64,24,48,12,40", help="prompt lengths, cycled (default 8,32,...)")
    ap.add_argument("--max-batch", type=int, default=16, help="the server's --max-batch (default 16)")
    ap.add_argument("--repeats", type=int, default=3, help="rounds over the concurrencies (default 3)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    ap.add_argument("--seed", type=int, default=0, help="seed of weights, prompts and sampling (default 0)")
    ap.add_argument("--stack", default="auto", choices=("auto", "asyncio"),
                    help="uvicorn's loop and HTTP parser: auto (uvloop + httptools when installed) or asyncio + h11")
    ap.add_argument("--client", choices=sorted(CLIENTS), default="raw",
                    help="load generator: raw = JSON POSTs on kept-alive http.client connections (default; ~0.2 ms of "
                         "CPU a request), openai = the openai client (~2 ms a request, taken from the server's cores)")
    ap.add_argument("--aligned-lengths", action="store_true",
                    help="the workload before 2026-11-28: every direct batch of one prompt length (see workload)")
    ap.add_argument("--quick", action="store_true", help="concurrency 1,2, 2 requests of 4 tokens, 1 round; "
                                                         "writes bench_serve.quick.json")
    args = ap.parse_args()
    if args.quick:
        args.concurrency, args.requests, args.max_tokens, args.repeats, args.prompt_lens = "1,2", 2, 4, 1, "3,9"
    return args


def main() -> None:
    args = parse_args()
    cfg, ckpt, tables = stem_bench_model(args, "serve")
    tokdir = Path(tempfile.mkdtemp())
    train_bpe(TEXTS, vocab_size=300).save(str(tokdir / "tokenizer.json"))
    served = load_served(ckpt, Placement("host", tables_file=tables), max_batch=args.max_batch, model_name="bench",
                         tokenizer=tokdir)
    model, eos_ids = served.engine.model, served.engine.eos_ids
    lens = [int(x) for x in args.prompt_lens.split(",")]
    levels = [int(c) for c in args.concurrency.split(",")]
    rounds: dict[int, list[tuple[dict, dict]]] = {c: [] for c in levels}
    load = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
    stack = {} if args.stack == "auto" else {"loop": "asyncio", "http": "h11"}
    engine, metrics = served.engine, {}

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = uvicorn_server(served, "127.0.0.1", port, "warning", **stack)

    def drive():  # the rounds, on a thread of their own: engine and HTTP share the main thread, as in `stemlm serve`
        with load:
            load.submit(served_phase, url, "bench", workload(2, 1, lens, cfg.vocab_size, args.seed), 4,
                        args.client).result()
            for r in range(args.repeats):
                for c in rotated(levels, r):
                    work = workload(c, args.requests, lens, cfg.vocab_size, args.seed, args.aligned_lengths)
                    s = with_occupancy(engine, lambda: cpu_timed(lambda: load.submit(
                        served_phase, url, "bench", work, args.max_tokens, args.client).result()))
                    s["cpu_s"] += s["client_cpu_s"]  # the work a token costs: the server's and its clients'
                    e = with_occupancy(engine, lambda: cpu_timed(lambda: engine_phase(engine, work, args.max_tokens)))
                    # direct generation on the engine's thread, between requests (one OpenMP team, as served)
                    d = cpu_timed(lambda: engine.call(lambda: direct_phase(model, work, args.max_tokens, eos_ids)))
                    rounds[c].append((s, d, e))
                    print(f"round {r + 1} C={c:>2}: served {s['tokens_per_s']:8.1f} tok/s (p50 "
                          f"{s['latency_p50_s']:.3f} s, p95 {s['latency_p95_s']:.3f} s; {s['decode_steps']} steps of "
                          f"{s['rows_per_step']:.2f} rows), engine without HTTP {e['tokens_per_s']:8.1f} tok/s "
                          f"({e['decode_steps']} steps of {e['rows_per_step']:.2f} rows), direct "
                          f"{d['tokens_per_s']:8.1f} tok/s", flush=True)
            with urllib.request.urlopen(url + "/metrics") as resp:
                metrics.update(json.load(resp))

    run_served(served, server, alongside=drive, name="bench-driver")  # returns once drive() has ended, engine drained
    served.store.close()
    results = {}
    for c, rs in rounds.items():
        speeds = {k: [x[i]["tokens_per_s"] for x in rs] for i, k in enumerate(("served", "direct", "engine"))}
        ratio = paired_ratio(speeds["direct"], speeds["served"])
        batching, http = paired_ratio(speeds["direct"], speeds["engine"]), paired_ratio(speeds["engine"], speeds["served"])
        lost = [sum(st is None for st in s["per_request_tokens"]) for s, _, _ in rs]
        differ = [sum(st is not None and st != dt for st, dt in zip(s["per_request_tokens"], d["per_request_tokens"]))
                  for s, d, _ in rs]
        med = sorted(rs, key=lambda x: x[0]["tokens_per_s"])[len(rs) // 2]
        results[str(c)] = {**{k: {f: v for f, v in x.items() if f != "per_request_tokens"}
                              for k, x in zip(("served", "direct", "engine"), med)},
                           "overhead": ratio - 1, "overhead_rounds": [x - 1 for x in round_ratios(speeds["direct"],
                                                                                               speeds["served"])],
                           "overhead_of_continuous_batching": batching - 1, "overhead_of_http": http - 1,
                           "requests_lost": max(lost), "requests_with_other_token_counts_than_direct": max(differ),
                           "goal_overhead_10pct": ratio - 1 <= 0.10,
                           "steps_served_over_engine": statistics.median(
                               x[0]["decode_steps"] / x[2]["decode_steps"] for x in rs),
                           "cpu_overhead": paired_ratio(*[[x[i]["cpu_s"] / x[i]["tokens"] for x in rs] for i in (0, 1)]) - 1,
                           "cpu_overhead_of_http": paired_ratio(*[[x[i]["cpu_s"] / x[i]["tokens"] for x in rs]
                                                                   for i in (0, 2)]) - 1}
        print(f"C={c:>2}: overhead {100 * (ratio - 1):+.1f} % (goal <= 10 %; continuous batching "
              f"{100 * (batching - 1):+.1f} %, HTTP {100 * (http - 1):+.1f} %; decode steps served ÷ engine "
              f"{results[str(c)]['steps_served_over_engine']:.3f}), requests lost {max(lost)}; CPU per "
              f"token {100 * results[str(c)]['cpu_overhead']:+.1f} % (HTTP {100 * results[str(c)]['cpu_overhead_of_http']:+.1f} %)")
    name = "bench_serve" + ("_aligned" if args.aligned_lengths else "") + ("_openai" if args.client == "openai" else "")
    path = write_result(name, args.quick, {
        "config": {"preset": args.preset, "stem_layers": args.stem_layers, "tier": "host", "concurrency": args.concurrency,
                   "requests_per_client": args.requests, "max_tokens": args.max_tokens, "prompt_lens": args.prompt_lens,
                   "max_batch": args.max_batch, "repeats": args.repeats, "aligned_lengths": args.aligned_lengths,
                   "sampling": "temperature 1.0, seed per request",
                   "clients": f"{args.client} client threads in a separate process", "uvicorn": _stack(args.stack),
                   "server": "run_served: uvicorn and the engine (Engine.run_async) on the main thread's event loop"},
        "concurrency": results, "server_metrics": metrics})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
