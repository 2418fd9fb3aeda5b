"""Chat templates: found next to a checkpoint (or given), rendered in a sandbox; SmolLM2-Instruct's from its GGUF."""

import json

import pytest

pytest.importorskip("fastapi")

from stemlm.serve.api import ApiError  # noqa: E402
from stemlm.serve.chat import ChatTemplate, find_chat_template  # noqa: E402
from stemlm.data.codec import load_codec  # noqa: E402

from serve_helpers import CHAT_TEMPLATE, tiny_checkpoint  # noqa: E402


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("chat") / "tiny")


def test_template_is_found_in_the_checkpoint_or_given(ckpt, tmp_path):
    codec = load_codec(ckpt)
    assert find_chat_template(ckpt, codec) is None
    (ckpt / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages[0]['content'] }}"}))
    try:
        assert find_chat_template(ckpt, codec) == "{{ messages[0]['content'] }}"
        (ckpt / "chat_template.jinja").write_text(CHAT_TEMPLATE)
        assert find_chat_template(ckpt, codec) == CHAT_TEMPLATE  # transformers' own file comes first
        given = tmp_path / "t.jinja"
        given.write_text("X")
        assert find_chat_template(ckpt, codec, given) == "X"
        with pytest.raises(FileNotFoundError, match="does not exist"):
            find_chat_template(ckpt, codec, tmp_path / "missing.jinja")
    finally:
        for name in ("tokenizer_config.json", "chat_template.jinja"):
            (ckpt / name).unlink(missing_ok=True)


def test_render_ends_with_the_assistant_turn_and_refusals_are_400():
    t = ChatTemplate(CHAT_TEMPLATE)
    assert t.render([{"role": "user", "content": "hi"}]) == "<|pad|>user: hi\n<|pad|>assistant:"
    strict = ChatTemplate("{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}{% endif %}ok")
    with pytest.raises(ApiError, match="first must be user") as e:
        strict.render([{"role": "system", "content": "x"}])
    assert e.value.status == 400
    with pytest.raises(ValueError, match="does not compile"):
        ChatTemplate("{% for %}")
    sandboxed = ChatTemplate("{{ messages.__class__.__mro__ }}")
    with pytest.raises(ApiError):
        sandboxed.render([{"role": "user", "content": "x"}])


@pytest.mark.slow
def test_smollm2_instruct_keeps_its_gguf_template_and_answers_in_chat(tmp_path):
    import openai

    from stemlm.cli import main
    from stemlm.serve.server import ServerThread, load_served

    assert main(["convert", "--from-hf", "smollm2", "--out", str(tmp_path / "smollm2")]) == 0
    served = load_served(tmp_path / "smollm2", max_batch=2)
    assert served.chat is not None and "<|im_start|>" in served.chat.source
    rendered = served.chat.render([{"role": "user", "content": "Hi"}])
    assert rendered.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    with ServerThread(served) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        r = client.chat.completions.create(model="smollm2", temperature=0, max_tokens=24,
                                           messages=[{"role": "user", "content": "What is the capital of France?"}])
    print(f"\nSmolLM2-135M-Instruct: {r.choices[0].message.content!r} ({r.choices[0].finish_reason})")
    assert "Paris" in r.choices[0].message.content and r.choices[0].finish_reason == "stop"  # <|im_end|> ends it
