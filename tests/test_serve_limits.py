"""A server one can expose: API key, body / prompt / max_tokens limits (413), a bounded queue (429), a
per-request deadline (504), all answered in OpenAI's error shape; the engine's side of each."""

import threading

import pytest
import torch

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
requests = pytest.importorskip("requests")

from stemlm import StemLM, model_config  # noqa: E402
from stemlm.inference.sampling import SamplingParams  # noqa: E402
from stemlm.serve.engine import Engine, Finished, QueueFull, Request  # noqa: E402
from stemlm.serve.guard import Limits  # noqa: E402
from stemlm.serve.server import ServerThread, load_served  # noqa: E402

from serve_helpers import tiny_checkpoint  # noqa: E402

KEY = "sekret-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    ckpt = tiny_checkpoint(tmp_path_factory.mktemp("limits") / "tiny")
    limits = Limits(api_key=KEY, max_body_bytes=2000, max_prompt_tokens=50, max_new_tokens=40, max_queue=1,
                    request_timeout=600)
    served = load_served(ckpt, max_batch=1, model_name="tiny", limits=limits)
    with ServerThread(served) as url:
        yield served, url


def post(url, body, headers=AUTH, **kw):
    return requests.post(url + "/v1/completions", json=body, headers=headers, **kw)


def error_of(resp, status):
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


def test_the_api_key_is_required_except_for_health(server):
    _, url = server
    assert requests.get(url + "/health").status_code == 200
    assert "Bearer" in error_of(requests.get(url + "/v1/models"), 401)["message"]
    assert error_of(post(url, {"prompt": "hi"}, headers={"Authorization": "Bearer wrong"}), 401)["code"] == "invalid_api_key"
    assert requests.get(url + "/metrics", headers=AUTH).status_code == 200
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
    assert client.completions.create(model="tiny", prompt="The cat", max_tokens=3).usage.completion_tokens == 3
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="nope", max_retries=0).models.list()


def test_oversized_requests_get_413(server):
    _, url = server
    assert "2000 bytes" in error_of(post(url, {"prompt": "x" * 3000}), 413)["message"]
    chunked = requests.post(url + "/v1/completions", data=iter([b'{"prompt": "', b"y" * 3000, b'"}']),
                            headers={**AUTH, "content-type": "application/json"})
    assert error_of(chunked, 413)["code"] == "body_too_large"  # no Content-Length: counted as it arrives
    assert "limit of 50" in error_of(post(url, {"prompt": [1] * 51}), 413)["message"]
    assert error_of(post(url, {"prompt": "hi", "max_tokens": 41}), 413)["param"] == "max_tokens"


def test_a_request_without_max_tokens_gets_at_most_the_limit(server):
    _, url = server
    r = post(url, {"prompt": [1, 2, 3], "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 16  # completions' default, under 40


def test_more_prompts_than_the_queue_holds_get_429(server):
    _, url = server
    err = error_of(post(url, {"prompt": [[1, 2], [3, 4]], "max_tokens": 2}), 429)
    assert err["code"] == "queue_full" and "1 of 1" not in err["message"]  # refused whole, nothing queued
    assert post(url, {"prompt": [[1, 2]], "max_tokens": 2}).status_code == 200


def test_a_request_past_its_deadline_gets_504_and_frees_its_slot(server):
    served, url = server
    engine = served.engine
    now = [0.0]
    engine.clock = lambda: now[0]
    step = engine.core.step

    def late_step(join=()):  # the request's deadline passes during its first decode step
        now[0] = 1e9
        return step(join)

    engine.core.step = late_step
    try:
        err = error_of(post(url, {"prompt": "The cat", "max_tokens": 30}), 504)
    finally:
        del engine.core.step
        engine.clock = __import__("time").monotonic
    assert err["code"] == "timeout"
    assert engine.wait_idle(60) and engine.metrics.outcomes["timeout"] == 1


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return StemLM(model_config("debug", ffn="stem", stem_layers="1/2")).eval()


def test_engine_queue_is_bounded_and_refuses_whole_groups(model):
    engine = Engine(model, max_batch=1, max_queue=2)  # not started: requests stay queued
    done = threading.Event()
    reqs = [Request([1, 2], SamplingParams(2), lambda ev: done.set() if isinstance(ev, Finished) else None)
            for _ in range(3)]
    engine.submit(reqs[0])
    with pytest.raises(QueueFull, match="1 of 2"):
        engine.submit(reqs[1], reqs[2])
    assert engine.counts()["requests_queued"] == 1
    engine.start()
    assert engine.wait_idle(60) and done.is_set()
    engine.shutdown()


def test_limits_are_checked():
    with pytest.raises(ValueError, match="max_queue must be >= 1"):
        Limits(max_queue=0)
    with pytest.raises(ValueError, match="request_timeout"):
        Limits(request_timeout=0)
    with pytest.raises(ValueError, match="api_key"):
        Limits(api_key="")
