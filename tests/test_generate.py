"""Generation: cached decode equals argmax over full forwards, seeded sampling, top-k/top-p, text CLI."""

import json

import pytest
import torch

from stemlm import StemLM, model_config
from stemlm.checkpoint.directory import save_model
from stemlm.cli import main as cli_main
from stemlm.data.tokenizer import train_bpe
from stemlm.inference.generate import generate, generate_ids, sample
from stemlm.data.codec import TextCodec
from stemlm.inference.text import TextStream, stream_text


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return StemLM(model_config("debug", ffn="stem", stem_layers="1/2")).eval()


def test_greedy_generation_equals_argmax_over_full_forward(model):
    prompt = torch.randint(0, 512, (2, 5))
    got = generate_ids(model, prompt, 8)
    seq = prompt
    with torch.no_grad():
        for _ in range(8):
            nxt = model(seq)[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], dim=1)
    assert torch.equal(got, seq)


def test_generation_stops_at_eos_and_max_seq_len(model):
    prompt = torch.randint(0, 512, (1, 4))
    first = int(generate_ids(model, prompt, 1)[0, -1])
    assert len(list(generate(model, prompt, 10, eos_id=first))) == 1
    long_prompt = torch.randint(0, 512, (1, model.cfg.max_seq_len - 2))
    assert len(list(generate(model, long_prompt, 10))) == 3  # positions run out; the last token is not fed back
    with pytest.raises(ValueError, match="max_seq_len"):
        list(generate(model, torch.zeros(1, model.cfg.max_seq_len + 1, dtype=torch.long), 1))


def test_sampling_is_deterministic_with_seed(model):
    prompt = torch.randint(0, 512, (1, 4))
    kw = dict(temperature=1.0, top_k=50, top_p=0.9)
    a = generate_ids(model, prompt, 10, seed=3, **kw)
    assert torch.equal(a, generate_ids(model, prompt, 10, seed=3, **kw))
    others = [generate_ids(model, prompt, 10, seed=s, **kw) for s in (4, 5, 6)]
    assert any(not torch.equal(a, o) for o in others)


def _empirical(logits, n=40_000, **kw):
    gen = torch.Generator().manual_seed(0)
    draws = sample(logits.expand(n, -1), generator=gen, **kw)
    return torch.bincount(draws, minlength=logits.shape[-1]).float() / n


def test_top_k_and_top_p_on_a_small_distribution():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()[None]
    torch.testing.assert_close(_empirical(logits, temperature=1.0), probs, atol=0.01, rtol=0)
    torch.testing.assert_close(_empirical(logits, temperature=1.0, top_k=2), torch.tensor([0.625, 0.375, 0, 0]),
                               atol=0.01, rtol=0)
    # nucleus 0.75: 0.5 alone is short of it, 0.5 + 0.3 reaches it, so {0, 1} remain
    torch.testing.assert_close(_empirical(logits, temperature=1.0, top_p=0.75), torch.tensor([0.625, 0.375, 0, 0]),
                               atol=0.01, rtol=0)
    torch.testing.assert_close(_empirical(logits, temperature=1.0, top_p=0.4), torch.tensor([1.0, 0, 0, 0]))
    torch.testing.assert_close(_empirical(logits, temperature=1.0, top_k=3, top_p=0.9),
                               torch.tensor([0.5, 0.3, 0.15, 0]) / 0.95, atol=0.01, rtol=0)
    sharp = _empirical(logits, temperature=0.25)  # p^4, renormalised
    torch.testing.assert_close(sharp, probs ** 4 / (probs ** 4).sum(), atol=0.01, rtol=0)
    assert torch.equal(sample(torch.tensor([[0.1, 2.0, 0.3]])), torch.tensor([1]))  # temperature 0 = greedy
    for bad in (dict(temperature=-1.0), dict(temperature=1.0, top_k=0), dict(temperature=1.0, top_p=0.0)):
        with pytest.raises(ValueError):
            sample(logits, **bad)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, model):
    texts = ["The capital of France is Paris. Ünïcödé — ok."] * 40
    tok = train_bpe(texts, vocab_size=300)
    path = tmp_path_factory.mktemp("gen") / "ckpt"
    save_model(model, path)
    tok.save(str(path / "tokenizer.json"))
    return path, tok


def test_stream_text_joins_to_the_full_decode(ckpt):
    _, tok = ckpt
    codec = TextCodec(tok)
    ids = codec.encode("Ünïcödé — ok. The capital", special=True)
    assert "".join(stream_text(codec, ids)) == codec.decode(ids)


def test_text_stream_cuts_at_a_stop_string_split_across_tokens(ckpt):
    _, tok = ckpt
    codec = TextCodec(tok)
    ids = codec.encode("The capital of France is Paris. Ünïcödé", special=False)
    stream = TextStream(codec, stops=["is Par", "zzz"])
    pieces = [stream.push(t) for t in ids]
    assert stream.stopped and stream.text == "The capital of France "
    assert "".join(pieces) + stream.finish() == "The capital of France "
    assert all("is" not in p for p in pieces)  # "is" could start the stop string: held back, then dropped
    free = TextStream(codec, stops=["zzz"])
    assert "".join(free.push(t) for t in ids) + free.finish() == codec.decode(ids) and not free.stopped


@pytest.mark.parametrize("tables", ["device", "host", "disk"])
def test_cli_generate_same_text_on_every_tier(ckpt, capsys, tables):
    path, _ = ckpt
    args = ["generate", "--ckpt", str(path), "--prompt", "The capital", "--max-new-tokens", "6", "--tables", tables]
    assert cli_main(args + (["--cache-rows", "4"] if tables != "device" else [])) == 0
    out = capsys.readouterr().out
    assert out.startswith("The capital")
    assert cli_main(["generate", "--ckpt", str(path), "--prompt", "The capital", "--max-new-tokens", "6"]) == 0
    assert capsys.readouterr().out == out
    assert cli_main(args + ["--stats"]) == 0
    stats = json.loads(capsys.readouterr().err)
    assert stats["tier"] == tables and stats["new_tokens"] >= 1


@pytest.mark.parametrize("sampling", [[], ["--temperature", "0.9", "--top-k", "40", "--seed", "3"]])
def test_cli_several_prompts_as_one_batch_print_what_each_prints_alone(ckpt, capsys, sampling):
    path, _ = ckpt
    texts = ["The capital", "Ünïcödé", "a"]
    base = ["generate", "--ckpt", str(path), "--max-new-tokens", "6", "--tables", "host", *sampling]
    alone = []
    for text in texts:
        assert cli_main(base + ["--prompt", text]) == 0
        alone.append(capsys.readouterr().out)
    assert cli_main(base + [a for t in texts for a in ("--prompt", t)] + ["--stats"]) == 0
    captured = capsys.readouterr()
    assert captured.out == "".join(alone)
    assert json.loads(captured.err)["new_tokens"] >= 3


def test_cli_errors_are_clear(ckpt, tmp_path, capsys, model):
    path, tok = ckpt
    bare = tmp_path / "bare"
    save_model(model, bare)
    assert cli_main(["generate", "--ckpt", str(bare), "--prompt", "hi"]) == 2
    assert "--tokenizer" in capsys.readouterr().err
    assert cli_main(["generate", "--ckpt", str(bare), "--prompt", "hi", "--tokenizer", str(path / "tokenizer.json")]) == 0
    capsys.readouterr()
    small = tmp_path / "small"
    save_model(StemLM(model_config("debug", vocab_size=64)), small)
    tok.save(str(small / "tokenizer.json"))
    assert cli_main(["generate", "--ckpt", str(small), "--prompt", "The capital of France"]) == 2
    assert "out of range" in capsys.readouterr().err
    (bare / "model.safetensors").write_bytes(b"\x00" * 4)
    assert cli_main(["generate", "--ckpt", str(bare), "--prompt", "hi", "--tokenizer", str(path), "--tables", "disk"]) == 2
    assert "corrupt" in capsys.readouterr().err


def test_onednn_generation_matches_aten_logits_and_tokens(ckpt, capsys):
    from stemlm.store import open_model
    from stemlm.runtime.matmul import onednn_available, use_matmul_backend

    if not onednn_available():
        pytest.skip("this PyTorch build has no oneDNN")
    path, _ = ckpt
    aten_model, onednn_model = open_model(path).eval(), open_model(path).eval()
    use_matmul_backend(onednn_model, "onednn")
    prompt = torch.randint(0, aten_model.cfg.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(onednn_model(prompt), aten_model(prompt), rtol=1e-5, atol=1e-5)
    assert torch.equal(generate_ids(onednn_model, prompt, 6), generate_ids(aten_model, prompt, 6))
    texts = []
    for backend in ("aten", "onednn"):
        assert cli_main(["generate", "--ckpt", str(path), "--prompt", "The capital", "--max-new-tokens", "6",
                         "--matmul", backend]) == 0
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1]
