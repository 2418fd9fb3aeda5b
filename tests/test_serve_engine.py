"""The continuous-batching engine: requests that join a running batch decode as they would alone."""

import threading
import time

import pytest
import torch

from stemlm import StemLM, model_config
from stemlm.inference.batch_generate import SamplingParams
from stemlm.serve.engine import Engine, Finished, PromptLogprobs, Request, Token
from stemlm.store import Placement, offload_tables

from serve_helpers import alone


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return StemLM(model_config("debug", ffn="stem", stem_layers="1/2")).eval()


def prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 512, (n,), generator=g).tolist() for n in lengths]


class Collector:
    """Events of several requests, and a wait for all of them to finish."""

    def __init__(self, n):
        self.tokens = {i: [] for i in range(n)}
        self.events = {i: [] for i in range(n)}
        self.done = {}
        self.all_done = threading.Event()
        self.n = n

    def sink(self, i):
        def put(ev):
            self.events[i].append(ev)
            if isinstance(ev, Token):
                self.tokens[i].append(ev.id)
            elif isinstance(ev, Finished):
                self.done[i] = ev.reason
                if len(self.done) == self.n:
                    self.all_done.set()
        return put


def run(engine, ps, params, gaps=None, **kw):
    out = Collector(len(ps))
    reqs = [Request(p, sp, out.sink(i), **kw) for i, (p, sp) in enumerate(zip(ps, params))]
    for i, req in enumerate(reqs):
        engine.submit(req)
        time.sleep(gaps[i] if gaps else 0)
    assert out.all_done.wait(60)
    return out, reqs


@pytest.mark.parametrize("max_batch", [1, 3, 8])
def test_requests_arriving_mid_flight_decode_as_alone(model, max_batch):
    ps = prompts((3, 9, 1, 6, 12, 2, 5))
    params = [SamplingParams(6 + 3 * i, temperature=0.0 if i % 2 else 0.9, top_k=40 if i % 3 else None, seed=i)
              for i in range(len(ps))]
    engine = Engine(model, max_batch=max_batch).start()
    try:
        out, _ = run(engine, ps, params, gaps=[0.003 * (i % 3) for i in range(len(ps))])
    finally:
        engine.shutdown()
    for i, (p, sp) in enumerate(zip(ps, params)):
        assert out.tokens[i] == alone(model, p, sp, None), f"request {i}"
        assert out.done[i] == "length"
    assert engine.metrics.snapshot()["generated_tokens"] == sum(sp.max_new_tokens for sp in params)


def test_newcomers_to_a_running_batch_are_prefilled_in_its_step(model):
    """Turn by turn (the engine's loop body, on this thread): a group joining running rows is prefilled in the
    step's forward (``DecodeCore.step(join=...)``), one joining an idle batch in a forward of its own; the events
    and tokens are those each request gets alone, prompt logprobs first."""
    ps = prompts((5, 3, 11, 2, 7))
    params = [SamplingParams(4 + i, temperature=0.0 if i % 2 else 0.9, seed=i) for i in range(len(ps))]
    engine = Engine(model, max_batch=4)
    out = Collector(len(ps))
    reqs = [Request(p, sp, out.sink(i), prompt_logprobs=1 if i == 2 else None)
            for i, (p, sp) in enumerate(zip(ps, params))]
    engine.submit(*reqs[:2])
    assert engine._turn()  # an idle batch: a prefill of its own, then the step
    assert [len(out.tokens[i]) for i in range(2)] == [2, 2]
    engine.submit(*reqs[2:4])
    assert engine._turn()  # merged: the newcomers get their first token in the running rows' step
    assert [len(out.tokens[i]) for i in range(4)] == [3, 3, 1, 1]
    assert isinstance(out.events[2][0], PromptLogprobs) and isinstance(out.events[2][1], Token)
    engine.submit(reqs[4])  # waits for a free row
    while not out.all_done.is_set():
        assert engine._turn()
    m = engine.metrics.snapshot()
    assert m["prefill_groups_merged"] >= 2 and m["prefill_groups"] == m["prefill_groups_merged"] + 1
    # every step decodes one token of each running row; each request's first token came from its prefill
    assert m["decode_rows"] == m["generated_tokens"] - len(ps) and 0 < m["decode_steps"] <= m["decode_rows"]
    for i, (p, sp) in enumerate(zip(ps, params)):
        assert out.tokens[i] == alone(model, p, sp, None), f"request {i}"
    assert [lp for lp, _ in out.events[2][0].entries[1:]] == pytest.approx(
        [lp for lp, _ in alone_prompt_logprobs(model, ps[2])], abs=1e-5)


def alone_prompt_logprobs(model, prompt):
    from stemlm.inference.core import DecodeCore, Generation

    seq = Generation(prompt, SamplingParams(1), prompt_logprobs=1)
    DecodeCore(model, max_rows=1).add([seq])
    return seq.prompt_entries[1:]


def test_eos_stop_and_context_end_finish_requests(model):
    p = prompts((4,))[0]
    free = alone(model, p, SamplingParams(8), None)
    engine = Engine(model, eos_id=free[2]).start()
    try:
        out, _ = run(engine, [p, p, list(range(126))], [SamplingParams(8), SamplingParams(8), SamplingParams(50)],
                     stop=None)
        stop_out, _ = run(engine, [p], [SamplingParams(8)], stop=lambda toks: len(toks) == 2)
    finally:
        engine.shutdown()
    assert out.tokens[0] == free[:3] and out.done[0] == "stop"  # eos is included, then the request ends
    assert len(out.tokens[2]) == 128 - 126 + 1 and out.done[2] == "length"  # the context ran out
    assert stop_out.tokens[0] == free[:2] and stop_out.done[0] == "stop"


def test_cancelled_request_leaves_and_others_go_on(model):
    ps = prompts((5, 7))
    params = [SamplingParams(100), SamplingParams(60)]
    engine = Engine(model).start()
    out = Collector(2)
    reqs = []

    def sink0(ev):
        out.sink(0)(ev)
        if isinstance(ev, Token) and len(out.tokens[0]) == 5:
            reqs[0].cancel()

    reqs = [Request(ps[0], params[0], sink0), Request(ps[1], params[1], out.sink(1))]
    try:
        for r in reqs:
            engine.submit(r)
        assert out.all_done.wait(60)
    finally:
        engine.shutdown()
    assert out.done == {0: "cancelled", 1: "length"}
    assert 5 <= len(out.tokens[0]) <= 6  # dropped at the next step
    assert out.tokens[1] == alone(model, ps[1], params[1], None)
    assert engine.counts() == {"requests_running": 0, "requests_queued": 0}
    assert engine.metrics.snapshot()["requests_cancelled"] == 1


def test_prompt_logprobs_equal_the_full_forward(model):
    ps = prompts((6, 3))
    engine = Engine(model).start()
    try:
        out, _ = run(engine, ps, [SamplingParams(0), SamplingParams(1)], prompt_logprobs=2, logprobs=0)
    finally:
        engine.shutdown()
    for i, p in enumerate(ps):
        entries = next(ev for ev in out.events[i] if isinstance(ev, PromptLogprobs)).entries
        with torch.no_grad():
            lp = torch.log_softmax(model(torch.tensor([p]))[0].float(), -1)  # (T, V)
        assert entries[0] == (None, None) and len(entries) == len(p)
        want = lp[:-1].gather(-1, torch.tensor(p[1:])[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor([e[0] for e in entries[1:]]), want, atol=1e-5, rtol=0)
        assert [t for t, _ in entries[1][1]] == lp[0].topk(2).indices.tolist()
    assert out.done == {0: "length", 1: "length"} and out.tokens[0] == []
    gen = [ev for ev in out.events[1] if isinstance(ev, Token)][0]
    with torch.no_grad():
        best = float(torch.log_softmax(model(torch.tensor([ps[1]]))[0, -1], -1).max())
    assert gen.logprob == pytest.approx(best, abs=1e-5)  # greedy: the chosen token is the most likely


def test_offloaded_tables_serve_the_same_tokens(model, tmp_path):
    import copy

    ps = prompts((4, 8, 2))
    params = [SamplingParams(10, temperature=0.7, seed=3)] * 3
    ref = [alone(model, p, sp, None) for p, sp in zip(ps, params)]
    host = copy.deepcopy(model)
    store = offload_tables(host, Placement("host", cache_rows=8))
    engine = Engine(host, store=store).start()
    try:
        out, _ = run(engine, ps, params)
    finally:
        engine.shutdown()
        store.close()
    assert [out.tokens[i] for i in range(3)] == ref
    assert store.stats()["rows_moved"] > 0


def test_shutdown_drains_queued_and_running_requests(model):
    ps = prompts((3, 4, 5))
    engine = Engine(model, max_batch=1).start()
    out = Collector(3)
    for i, p in enumerate(ps):
        engine.submit(Request(p, SamplingParams(20), out.sink(i)))
    engine.shutdown(drain=True)
    assert out.done == {0: "length", 1: "length", 2: "length"}
    assert all(len(t) == 20 for t in out.tokens.values())
    with pytest.raises(RuntimeError, match="shutting down"):
        engine.submit(Request(ps[0], SamplingParams(2), out.sink(0)))


def test_a_failed_step_fails_its_requests_and_the_engine_goes_on(model):
    p = prompts((4,))[0]
    engine = Engine(model).start()

    def boom(*args):
        raise RuntimeError("boom")

    engine.core.step = boom  # the next decode step fails (the engine then starts a fresh batch)
    try:
        failed, _ = run(engine, [p], [SamplingParams(5)])
        fine, _ = run(engine, [p], [SamplingParams(5)])
    finally:
        engine.shutdown()
    assert failed.done[0] == "error" and "boom" in failed.events[0][-1].message and len(failed.tokens[0]) == 1
    assert fine.done[0] == "length" and fine.tokens[0] == alone(model, p, SamplingParams(5), None)
    assert engine.metrics.snapshot()["requests_failed"] == 1


def test_a_failing_sink_drops_only_its_own_request(model):
    ps = prompts((4, 6))
    out = Collector(1)

    def broken(ev):
        raise RuntimeError("listener gone")

    engine = Engine(model).start()
    try:
        bad = Request(ps[0], SamplingParams(50), broken)
        engine.submit(bad)
        engine.submit(Request(ps[1], SamplingParams(8), out.sink(0)))
        assert out.all_done.wait(60)
    finally:
        engine.shutdown()
    assert bad.cancelled and out.tokens[0] == alone(model, ps[1], SamplingParams(8), None)
    assert engine.counts()["requests_running"] == 0 and engine.metrics.snapshot()["requests_failed"] == 0


def test_run_async_runs_on_the_event_loop_thread_between_its_other_work(model):
    """``run_async`` (``stemlm serve``: the engine a task of uvicorn's loop) claims the loop's thread at once:
    requests from other threads decode as alone, the loop's own callbacks keep running while requests decode,
    ``call`` runs on that thread between requests (its exception raised in its caller), and ``shutdown`` ends
    the coroutine."""
    import asyncio

    engine = Engine(model, max_batch=4)
    ps = prompts((4, 7, 3))
    params = [SamplingParams(6, temperature=0.0), SamplingParams(9, temperature=0.8, seed=3), SamplingParams(5)]
    ticks = []

    async def main():
        here = threading.current_thread()
        task = asyncio.ensure_future(engine.run_async())
        assert engine._thread is here  # claimed before the task first runs: a lifespan's start() spawns nothing
        assert engine.start() is engine and engine._thread is here

        async def tick():  # other work of the loop, interleaved with the decode steps
            while not task.done():
                ticks.append(len(ticks))
                await asyncio.sleep(0)
        ticker = asyncio.ensure_future(tick())
        out = (await asyncio.to_thread(run, engine, ps, params))[0]
        on = await asyncio.to_thread(engine.call, lambda: (threading.current_thread(), engine.counts()))
        with pytest.raises(ZeroDivisionError):  # a call's exception is raised in its caller
            await asyncio.to_thread(engine.call, lambda: 1 / 0)
        with pytest.raises(RuntimeError, match="another thread"):
            engine.run_async()
        engine.shutdown()
        await asyncio.wait_for(task, 30)
        await ticker
        return out, on, here

    out, on, here = asyncio.run(main())
    assert [out.tokens[i] for i in range(3)] == [alone(model, p, sp, None) for p, sp in zip(ps, params)]
    assert on == (here, {"requests_running": 0, "requests_queued": 0})
    assert engine._stopped.is_set() and len(ticks) > 10
    with pytest.raises(Exception, match="shutting down"):
        engine.submit(Request(ps[0], params[0], lambda ev: None))
