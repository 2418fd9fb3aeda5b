"""Soak test of `stemlm serve`: many concurrent clients, a share of them bad, oversized or abandoned.

A debug-sized STEM model (tables on the host tier, random weights, a small BPE tokenizer) is served
in this process as ``stemlm serve`` serves it (``run_served``: uvicorn and the engine on the main
thread) on 127.0.0.1 with an API key and small limits (4 KiB bodies, 64 prompt tokens, 24 new tokens,
a batch of 8 and a queue of ``--clients // 4`` prompts, so that bursts meet 429s, a 30 s deadline).
``--clients`` threads then send requests one
after another until ``--seconds`` have passed or ``--max-requests`` were sent; each request is drawn
(seeded) from these kinds:

    ok, ok_stream      a completion (whole or streamed) that must succeed (a 429 "queue full" is an answer too:
                       the client backs off 20-100 ms, then goes on)
    bad                invalid JSON, a token id out of range, an unknown model, a negative max_tokens (400/404)
    unauthorized       a wrong API key (401)
    oversized          a body, a prompt or a max_tokens over the limit (413)
    abandoned          the client closes the connection mid-stream or while waiting (no answer expected)

Afterwards the engine must go idle; then no slot may be left (requests running or queued), every
request the engine admitted must have finished, no request may have got an unexpected answer or
none ("lost"), and the server's RSS (this process) is compared at the start (after a warm-up), at
half time and at the end. JSON: requests, answers by kind and status, p50/p95 latency of the ok
requests, RSS, the server's /metrics. ``tests/test_serve_soak.py`` runs a short version.

    python benchmarks/soak_serve.py                  # 16 clients, 120 s
    python benchmarks/soak_serve.py --quick          # 4 clients, 5 s (writes soak_serve.quick.json)
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import statistics
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import torch

KEY = "soak-key"
KINDS = {"ok": 0.45, "ok_stream": 0.15, "bad": 0.1, "unauthorized": 0.05, "oversized": 0.1, "abandoned": 0.15}
EXPECTED = {"ok": {200, 429}, "ok_stream": {200, 429}, "bad": {400, 404}, "unauthorized": {401}, "oversized": {413},
            "abandoned": {None}}
TEXTS = ["The capital of France is Paris. The capital of Spain is Madrid. Once upon a time there was a cat."] * 40


def rss_mb() -> float:
    """This process's resident memory in MiB (Linux)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def build_server(root: Path, clients: int, seed: int = 0):
    """A served debug STEM model (host tables) with an API key and small limits; not yet started."""
    from stemlm import StemLM, model_config
    from stemlm.data.tokenizer import train_bpe
    from stemlm.checkpoint.directory import save_model
    from stemlm.serve.guard import Limits
    from stemlm.serve.server import load_served
    from stemlm.store import Placement

    tok = train_bpe(TEXTS, vocab_size=300)
    torch.manual_seed(seed)
    cfg = model_config("debug", ffn="stem", stem_layers="1/2", vocab_size=tok.get_vocab_size(), max_seq_len=128)
    save_model(StemLM(cfg).eval(), root / "ckpt")
    tok.save(str(root / "ckpt" / "tokenizer.json"))
    limits = Limits(api_key=KEY, max_body_bytes=4096, max_prompt_tokens=64, max_new_tokens=24,
                    max_queue=max(1, clients // 4), request_timeout=30)
    return load_served(root / "ckpt", Placement("host", cache_rows=64), max_batch=8, model_name="soak", limits=limits)


def request_for(kind: str, rng: random.Random, vocab: int) -> tuple[str, dict | bytes, dict]:
    """``(path, body, headers)`` of one request of ``kind``."""
    auth = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
    good = {"prompt": prompt, "max_tokens": rng.randint(1, 24), "temperature": rng.choice([0.0, 1.0]),
            "seed": rng.randrange(1000)}
    if kind in ("ok", "abandoned"):
        return "/v1/completions", {**good, "stream": kind == "abandoned" and rng.random() < 0.5}, auth
    if kind == "ok_stream":
        return "/v1/completions", {**good, "stream": True}, auth
    if kind == "unauthorized":
        return "/v1/completions", good, {**auth, "Authorization": "Bearer wrong"}
    if kind == "bad":
        return "/v1/completions", rng.choice([b'{"prompt": [1, 2', {**good, "prompt": [vocab + 5]},
                                              {**good, "model": "other"}, {**good, "max_tokens": -3}]), auth
    return "/v1/completions", rng.choice([{**good, "prompt": "x" * 5000}, {**good, "prompt": [1] * 65},
                                          {**good, "max_tokens": 25}]), auth


def send(port: int, kind: str, path: str, body, headers: dict, rng: random.Random) -> tuple[int | None, int]:
    """Send one request; ``(status or None when abandoned, completion tokens)``. Raises if it was lost."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("POST", path, body if isinstance(body, bytes) else json.dumps(body).encode(), headers)
        if kind == "abandoned":
            if body.get("stream"):
                conn.getresponse().read(rng.randint(1, 200))  # a few chunks, then gone
            return None, 0  # a non-streaming one is abandoned before its answer
        resp = conn.getresponse()
        data = resp.read()
        if resp.status != 200:
            return resp.status, 0
        if body.get("stream"):
            lines = [x for x in data.decode().split("\n\n") if x]
            if lines[-1] != "data: [DONE]" or any("error" in json.loads(x[6:]) for x in lines[:-1]):
                raise RuntimeError(f"a stream ended without [DONE] or with an error: {lines[-2:]}")
            return 200, len(lines) - 2
        usage = json.loads(data)["usage"]
        if usage["completion_tokens"] > body["max_tokens"]:
            raise RuntimeError(f"{usage['completion_tokens']} tokens for max_tokens={body['max_tokens']}")
        return 200, usage["completion_tokens"]
    finally:
        conn.close()


def soak(served, port: int, clients: int, seconds: float, max_requests: int, seed: int = 0) -> dict:
    """Run the clients against the started server; the figures (see the module docstring)."""
    vocab = served.engine.model.cfg.vocab_size
    lock, answers, latencies, lost = threading.Lock(), Counter(), [], []
    sent = [0]
    start = time.monotonic()
    mid: list[float] = []

    def client(c: int) -> None:
        rng = random.Random(seed * 1000 + c)
        while True:
            with lock:
                if sent[0] >= max_requests or time.monotonic() - start > seconds:
                    return
                sent[0] += 1
                if not mid and (time.monotonic() - start > seconds / 2 or sent[0] > max_requests / 2):
                    mid.append(rss_mb())
            kind = rng.choices(list(KINDS), list(KINDS.values()))[0]
            t0 = time.monotonic()
            try:
                status, _ = send(port, kind, *request_for(kind, rng, vocab), rng)
            except Exception as e:  # a request without the answer it should have had
                with lock:
                    lost.append(f"{kind}: {type(e).__name__}: {e}")
                continue
            if status == 429:  # as a client should: back off a little before the next request
                time.sleep(rng.uniform(0.02, 0.1))
            with lock:
                answers[f"{kind} {status}"] += 1
                if status not in EXPECTED[kind]:
                    lost.append(f"{kind}: unexpected status {status}")
                if kind == "ok" and status == 200:
                    latencies.append(time.monotonic() - t0)

    rss_start = rss_mb()
    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - start
    idle = served.engine.wait_idle(60)
    counts, metrics = served.engine.counts(), served.engine.metrics.snapshot()
    latencies.sort()
    return {"requests": sent[0], "seconds": round(wall, 2), "answers": dict(sorted(answers.items())),
            "errors_by_kind": _errors_by_kind(answers), "lost": len(lost), "lost_examples": lost[:5],
            "engine_idle": idle, "slots_left": counts["requests_running"] + counts["requests_queued"],
            "admitted_not_finished": metrics["requests_received"] - metrics["requests_finished"],
            "latency_ok_p50_s": statistics.median(latencies) if latencies else None,
            "latency_ok_p95_s": latencies[int(0.95 * (len(latencies) - 1))] if latencies else None,
            "rss_mb": {"start": round(rss_start, 1), "half": round(mid[0], 1) if mid else None,
                       "end": round(rss_mb(), 1)},
            "server_metrics": metrics}


def _errors_by_kind(answers: Counter) -> dict:
    out: dict[str, int] = Counter()
    for key, n in answers.items():
        status = key.split()[1]
        if status not in ("200", "None"):
            out[status] += n
    return dict(sorted(out.items()))


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=16, help="concurrent client threads (default 16)")
    ap.add_argument("--seconds", type=float, default=120.0, help="how long the clients send (default 120)")
    ap.add_argument("--max-requests", type=int, default=20000, help="requests at most (default 20000)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the model and the request mix (default 0)")
    ap.add_argument("--quick", action="store_true", help="4 clients for 5 s; writes soak_serve.quick.json")
    args = ap.parse_args()
    if args.quick:
        args.clients, args.seconds = 4, 5.0
    return args


def served_soak(served, clients: int, seconds: float, max_requests: int, seed: int = 0) -> dict:
    """A warm-up, then ``soak``, against ``served`` run as ``stemlm serve`` runs it (``run_served``: uvicorn and
    the engine on this thread's event loop, the clients on threads beside it); the soak's figures."""
    from stemlm.serve.server import free_port, run_served, uvicorn_server

    port, out = free_port(), {}

    def load():
        soak(served, port, 2, 30.0, 20, seed=seed + 1)  # warm-up (20 requests): allocator and caches settle
        out.update(soak(served, port, clients, seconds, max_requests, seed))

    run_served(served, uvicorn_server(served, "127.0.0.1", port, "warning"), alongside=load, name="soak-clients")
    return out


def main() -> None:
    from _train_bench import write_result

    args = parse_args()
    served = build_server(Path(tempfile.mkdtemp()), args.clients, args.seed)
    result = served_soak(served, args.clients, args.seconds, args.max_requests, args.seed)
    served.store.close()
    print(json.dumps({k: v for k, v in result.items() if k != "server_metrics"}, indent=1))
    path = write_result("soak_serve", args.quick, {"config": vars(args), **result})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
