"""stemlm serve over HTTP, through the real ``openai`` client: completions, chat, streaming, cancellation, metrics."""

import http.client
import json
import threading
from concurrent.futures import ThreadPoolExecutor

import requests
import pytest
import torch

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from stemlm.inference.batch_generate import SamplingParams  # noqa: E402
from stemlm.store import open_model  # noqa: E402
from stemlm.serve.responses import token_text  # noqa: E402
from stemlm.serve.server import ServerThread, load_served  # noqa: E402
from stemlm.store import Placement  # noqa: E402

from serve_helpers import CHAT_TEMPLATE, alone, tiny_checkpoint  # noqa: E402


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    (root / "chat.jinja").write_text(CHAT_TEMPLATE)
    return tiny_checkpoint(root / "tiny")


@pytest.fixture(scope="module")
def server(ckpt):
    served = load_served(ckpt, Placement("host", cache_rows=32), max_batch=4, model_name="tiny",
                         chat_template=ckpt.parent / "chat.jinja")
    with ServerThread(served) as url:
        yield served, url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[1] + "/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def reference(ckpt):
    return open_model(ckpt)


def metrics(url):
    return requests.get(url + "/metrics").json()


def assert_slot_freed(server, cancelled):
    """Once the engine is idle, ``/metrics`` counts ``cancelled`` cancelled requests and none running."""
    served, url = server
    assert served.engine.wait_idle(60)
    m = metrics(url)
    assert m["requests_cancelled"] == cancelled and m["requests_running"] == 0


def test_health_models_and_metrics(server, client):
    served, url = server
    assert requests.get(url + "/health").json() == {"status": "ok"}
    assert [m.id for m in client.models.list().data] == ["tiny"]
    client.completions.create(model="tiny", prompt="The capital", max_tokens=3, temperature=0)
    m = metrics(url)
    for key in ("tokens_per_s", "requests_running", "requests_queued", "requests_finished", "queue_length",
                "generated_tokens", "prompt_tokens", "prefill_groups", "prefill_groups_merged", "decode_steps", "decode_rows"):
        assert key in m
    assert m["generated_tokens"] >= 1 and m["requests_running"] == 0
    store = m["table_store"]
    assert store["tier"] == "host" and store["rows_moved"] > 0 and store["bytes_moved"] > 0
    assert 0 <= store["cache"]["hit_rate"] <= 1


def test_concurrent_requests_give_the_tokens_of_direct_generation(server, client, reference):
    codec = server[0].codec
    texts = ["The capital of France", "Once upon", "The cat", "Madrid is the capital of Spain. The", "Paris"]
    settings = [dict(temperature=0), dict(temperature=0.9, seed=7), dict(temperature=0.8, top_p=0.9, seed=1),
                dict(temperature=0), dict(temperature=1.0, seed=3, extra_body={"top_k": 20})]

    def ask(i):
        r = client.completions.create(model="tiny", prompt=texts[i], max_tokens=12 + 3 * i, logprobs=0, **settings[i])
        return r.choices[0], r.usage

    with ThreadPoolExecutor(5) as pool:
        results = list(pool.map(ask, range(5)))
    for i, (choice, usage) in enumerate(results):
        s = settings[i]
        sp = SamplingParams(12 + 3 * i, s["temperature"], s.get("extra_body", {}).get("top_k"), s.get("top_p"), s.get("seed"))
        prompt = codec.encode(texts[i], special=True)
        want = alone(reference, prompt, sp, codec.eos_id)
        assert choice.logprobs.tokens == [token_text(codec, t) for t in want], f"request {i}"
        assert choice.text == codec.decode(want)
        assert usage.prompt_tokens == len(prompt) and usage.completion_tokens == len(want)
        assert choice.finish_reason == ("stop" if want[-1] == codec.eos_id else "length")


def test_token_prompts_echo_and_scoring_logprobs(server, client, reference):
    codec = server[0].codec
    ids = codec.encode("The capital of Spain is Madrid", special=True)
    r = client.completions.create(model="tiny", prompt=[ids, ids[:4]], max_tokens=0, echo=True, logprobs=3)
    assert [c.index for c in r.choices] == [0, 1]
    lp = r.choices[0].logprobs
    with torch.no_grad():
        want = torch.log_softmax(reference(torch.tensor([ids]))[0], -1)  # (T, V)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    got = torch.tensor(lp.token_logprobs[1:])
    torch.testing.assert_close(got, want[:-1].gather(-1, torch.tensor(ids[1:])[:, None])[:, 0], atol=1e-5, rtol=0)
    assert all(len(t) <= 3 and max(t.values()) == pytest.approx(float(w.max()), abs=1e-5)
               for t, w in zip(lp.top_logprobs[1:], want[:-1]))
    assert lp.tokens == [token_text(codec, t) for t in ids]
    assert lp.text_offset[1] == len(lp.tokens[0]) and r.choices[0].text == codec.decode(ids)
    assert r.usage.prompt_tokens == len(ids) + 4 and r.usage.completion_tokens == 0


def test_streaming_gives_the_same_text_and_ends_with_done(server, client):
    kw = dict(model="tiny", prompt="Once upon a time", max_tokens=20, temperature=0.7, seed=5)
    whole = client.completions.create(**kw).choices[0]
    chunks = list(client.completions.create(stream=True, **kw))
    assert "".join(c.choices[0].text for c in chunks) == whole.text
    assert chunks[-1].choices[0].finish_reason == whole.finish_reason
    with requests.post(server[1] + "/v1/completions", json={**kw, "stream": True}, stream=True) as resp:
        lines = [line for line in resp.iter_lines(decode_unicode=True) if line]
    assert resp.headers["content-type"].startswith("text/event-stream")
    assert lines[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in lines)
    assert json.loads(lines[0][6:])["object"] == "text_completion"


def test_stop_strings_cut_the_text(server, client):
    kw = dict(model="tiny", prompt="The cat", max_tokens=30, temperature=0)
    full = client.completions.create(**kw).choices[0].text
    stop = full[len(full) // 2:len(full) // 2 + 2]
    assert stop.strip(), f"no usable stop string in {full!r}"
    cut = client.completions.create(stop=[stop], **kw).choices[0]
    assert cut.text == full[:full.index(stop)] and cut.finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(stop=stop, stream=True, **kw))
    assert streamed == cut.text


def test_chat_renders_the_template(server, client, reference):
    codec = server[0].codec
    messages = [{"role": "user", "content": "The capital of France?"}]
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0)
    prompt = codec.encode("<|pad|>user: The capital of France?\n<|pad|>assistant:", special=True)
    want = alone(reference, prompt, SamplingParams(10), codec.eos_id)
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == codec.decode(want)
    assert r.usage.prompt_tokens == len(prompt)
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == r.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens


def test_two_streams_one_cancelled_midway(server, client):
    url = server[1]
    before = metrics(url)["requests_cancelled"]
    kw = dict(model="tiny", temperature=0)
    long = client.completions.create(prompt="The cat", max_tokens=480, stream=True, **kw)
    other = client.completions.create(prompt="Once upon", max_tokens=200, stream=True, **kw)
    for _, _ in zip(range(3), long):
        pass
    long.close()  # the client goes away mid-stream
    chunks = list(other)
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")
    want = client.completions.create(prompt="Once upon", max_tokens=200, **kw).choices[0].text
    assert "".join(c.choices[0].text for c in chunks) == want
    assert_slot_freed(server, before + 1)


def test_a_client_that_gives_up_waiting_frees_its_slot(server):
    served, url = server
    engine = served.engine
    before = engine.metrics.snapshot()["requests_cancelled"]
    entered, release = threading.Event(), threading.Event()
    step = engine.core.step

    def held_step(join=()):  # the engine holds the request's first decode step until the client has gone
        entered.set()
        assert release.wait(60)
        return step(join)

    engine.core.step = held_step
    conn = http.client.HTTPConnection("127.0.0.1", int(url.rsplit(":", 1)[1]), timeout=60)
    try:
        conn.request("POST", "/v1/completions", json.dumps({"prompt": "The cat", "max_tokens": 480, "temperature": 0}),
                     {"content-type": "application/json"})
        assert entered.wait(60)
        (req,) = engine.running
        conn.close()  # the client gives up before the answer
        assert req.wait_cancelled(60)  # the handler saw the disconnect and cancelled its request
    finally:
        release.set()
        del engine.core.step
    assert engine.wait_idle(60)
    m = metrics(url)
    assert m["requests_cancelled"] == before + 1 and m["requests_running"] == 0 and req.tokens


@pytest.mark.parametrize("body,status,says", [
    ('{"prompt": "hi", "max_tokens": ', 400, "not valid JSON"),
    ({"model": "gpt-4", "prompt": "hi"}, 404, "does not exist"),
    ({"prompt": [1] * 600}, 400, "600 tokens, more than the model's context of 512"),
    ({"prompt": "hi", "max_tokens": 5000}, 400, "max_tokens=5000 is too large"),
    ({"prompt": "hi", "max_tokens": -1}, 400, "max_tokens must be >= 0"),
    ({"prompt": [5, 99999]}, 400, "token id 99999 is out of range"),
    ({"prompt": "hi", "n": 2}, 400, "n=2 is not supported"),
    ({"prompt": "hi", "temperature": -1}, 400, "temperature must be"),
    ({"max_tokens": 3}, 400, "prompt"),
    ({"prompt": []}, 400, "empty"),
    ({"prompt": [[]]}, 400, "empty"),
])
def test_bad_requests_get_clear_openai_errors(server, body, status, says):
    kw = {"data": body, "headers": {"content-type": "application/json"}} if isinstance(body, str) else {"json": body}
    resp = requests.post(server[1] + "/v1/completions", **kw)
    assert resp.status_code == status
    err = resp.json()["error"]
    assert says in err["message"] and set(err) == {"message", "type", "param", "code"}


def test_a_failed_generation_is_a_500_and_an_error_event(server, client):
    served, url = server

    def boom(*args):
        raise RuntimeError("boom")

    served.engine.core.step = boom  # the next decode step fails; the engine then starts a fresh batch
    with pytest.raises(openai.InternalServerError, match="generation failed: RuntimeError: boom"):
        client.completions.create(model="tiny", prompt="The cat", max_tokens=5, temperature=0)
    served.engine.core.step = boom
    with requests.post(url + "/v1/completions", json={"prompt": "The cat", "max_tokens": 5, "stream": True},
                       stream=True) as resp:
        lines = [line for line in resp.iter_lines(decode_unicode=True) if line]
    assert "boom" in json.loads(lines[-2][6:])["error"]["message"] and lines[-1] == "data: [DONE]"
    assert client.completions.create(model="tiny", prompt="The cat", max_tokens=5).usage.completion_tokens == 5


def test_openai_client_raises_on_errors(client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="hi")
    with pytest.raises(openai.BadRequestError, match="n=3"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], n=3)


def test_chat_without_a_template_is_a_clear_400(ckpt):
    served = load_served(ckpt, max_batch=2)
    assert served.chat is None
    with ServerThread(served) as url:
        resp = requests.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert resp.status_code == 400 and "--chat-template" in resp.json()["error"]["message"]


def test_shutdown_lets_in_flight_requests_finish(ckpt, reference):
    served = load_served(ckpt, max_batch=2)
    server = ServerThread(served)
    url = server.start()
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    stream = client.completions.create(model="tiny", prompt="The cat", max_tokens=300, temperature=0, stream=True)
    first = next(iter(stream))
    stopper = threading.Thread(target=server.stop)  # what SIGTERM does
    stopper.start()
    rest = list(stream)
    stopper.join(60)
    assert not server.thread.is_alive()
    want = alone(reference, served.codec.encode("The cat", special=True), SamplingParams(300), served.codec.eos_id)
    assert first.choices[0].text + "".join(c.choices[0].text for c in rest) == served.codec.decode(want)
    assert rest[-1].choices[0].finish_reason in ("length", "stop")
    with pytest.raises(requests.ConnectionError):
        requests.get(url + "/health")


def test_serve_forever_raises_when_http_cannot_start_and_the_engine_stops(ckpt):
    """``serve_forever`` runs the engine and HTTP on this (main) thread's event loop: a port that is taken ends
    both — the engine is shut down and uvicorn's exit is raised here — and the signal handlers are restored."""
    import signal
    import socket

    from stemlm.serve.server import serve_forever

    served = load_served(ckpt, max_batch=2, model_name="tiny")
    before = signal.getsignal(signal.SIGTERM)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(SystemExit):
            serve_forever(served, "127.0.0.1", taken.getsockname()[1], log_level="critical")
    assert served.engine._stopped.is_set()
    assert signal.getsignal(signal.SIGTERM) is before


def test_run_served_answers_on_one_thread_with_the_engine_and_reraises_what_runs_alongside(ckpt, reference):
    """``run_served`` (what ``stemlm serve`` runs): uvicorn and the engine share the calling thread's event loop;
    concurrent plain and streamed completions come back as each prompt decodes alone, the engine drains when
    the work alongside ends, and that work's exception is raised on the calling thread."""
    from stemlm.serve.server import free_port, run_served, uvicorn_server

    served = load_served(ckpt, max_batch=2, model_name="tiny")
    port = free_port()
    url, got = f"http://127.0.0.1:{port}", {}
    texts = ["The cat", "Once upon a time", "A dog and"]

    def complete(prompt, stream=False):
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0, "stream": stream}
        with requests.post(url + "/v1/completions", json=body, stream=stream) as resp:
            if not stream:
                return resp.json()["choices"][0]["text"]
            chunks = [json.loads(line[6:]) for line in resp.iter_lines(decode_unicode=True)
                      if line and line != "data: [DONE]"]
            return "".join(c["choices"][0]["text"] for c in chunks)

    def clients():
        with ThreadPoolExecutor(4) as pool:
            got["plain"] = list(pool.map(complete, texts))
            got["streamed"] = complete(texts[0], stream=True)
        raise KeyError("from alongside")

    with pytest.raises(KeyError, match="from alongside"):
        run_served(served, uvicorn_server(served, "127.0.0.1", port, "critical"), alongside=clients)
    want = [served.codec.decode(alone(reference, served.codec.encode(t, special=True), SamplingParams(12),
                                      served.codec.eos_id)) for t in texts]
    assert got["plain"] == want and got["streamed"] == want[0]
    assert served.engine._thread is threading.current_thread() and served.engine._stopped.is_set()
    with pytest.raises(requests.ConnectionError):
        requests.get(url + "/health")
