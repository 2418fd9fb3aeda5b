"""The fast engine answers every request as ReferenceLM does (fp32, 1e-4): every FFN kind, tables on
every tier, shared contexts, truncation, rolling windows, batched generation with stop sequences."""

import pytest
import torch

from stemlm import StemLM, model_config
from stemlm.data.tokenizer import train_bpe
from stemlm.eval.api import GenerateRequest, LoglikelihoodRequest, ReferenceLM
from stemlm.eval.engine import EvalEngine
from stemlm.data.codec import TextCodec
from stemlm.store import Placement, offload_tables

TEXTS = ["The capital of France is Paris.", "A dog ran in the park and sat on the mat.",
         "Tables hold one row per token; the cat saw them.", "Question: what is two plus two? Answer: four."] * 20
MAX_LENGTH = 40
KINDS = ["dense", "stem", "stem_dagger", "hash_moe", "ngram", "engram"]


@pytest.fixture(scope="module")
def tokens():
    return TextCodec(train_bpe(TEXTS, vocab_size=300))


def make_model(ffn: str) -> StemLM:
    torch.manual_seed(0)
    return StemLM(model_config("debug", ffn=ffn, stem_layers="1/2")).eval()


def requests(tokens):
    """Multiple-choice questions sharing contexts, empty and over-long contexts, duplicates."""
    long_ctx = " ".join(TEXTS[:6])  # longer than MAX_LENGTH tokens: cut from the left
    out = []
    for ctx in ("The capital of France is", "Question: what is two plus two? Answer:", "A dog ran in the ", long_ctx):
        out += [LoglikelihoodRequest(ctx, c) for c in (" Paris", " four.", " the mat and the cat", "park", " a")]
    out += [LoglikelihoodRequest("", "The cat"), LoglikelihoodRequest("The capital of France is", " Paris")]
    return out


def gen_requests():
    return [GenerateRequest("The capital of France is", ("\n",), 6), GenerateRequest("A dog", (" the", "."), 12),
            GenerateRequest("", (), 3), GenerateRequest(" ".join(TEXTS[:6]), ("zz",), 8),
            GenerateRequest("Question: what is", ("?",), 0), GenerateRequest("Tables hold", (), 30)]


def assert_same_answers(got, want):
    assert [g.n_tokens for g in got] == [w.n_tokens for w in want]
    assert [g.is_greedy for g in got] == [w.is_greedy for w in want]
    diff = max(abs(g.logprob - w.logprob) for g, w in zip(got, want))
    assert diff <= 1e-4, diff


@pytest.mark.parametrize("ffn", KINDS)
@pytest.mark.parametrize("batch_size", [1, 7])
def test_engine_equals_reference(tokens, ffn, batch_size):
    model = make_model(ffn)
    ref = ReferenceLM(model, tokens, model.cfg.vocab_size, MAX_LENGTH)
    engine = EvalEngine(model, tokens, max_length=MAX_LENGTH, batch_size=batch_size)
    want_gen = ref.generate_until(gen_requests())
    assert engine.generate_until(gen_requests()) == want_gen
    reqs = requests(tokens)
    assert_same_answers(engine.loglikelihood(reqs), ref.loglikelihood(reqs))
    ctx = [tokens.eot_id] + tokens.encode("The capital of France is")
    with torch.no_grad():
        greedy = [int(model(torch.tensor([ctx]))[0, -1].argmax())]
        greedy.append(int(model(torch.tensor([ctx + greedy]))[0, -1].argmax()))
    pairs = [(ctx, greedy), (ctx, greedy[:1] + [(greedy[1] + 1) % 300])]
    got = engine.score_pairs(pairs)
    assert_same_answers(got, [ref._score(c, t) for c, t in pairs])
    assert [g.is_greedy for g in got] == [True, False]
    texts = [" ".join(TEXTS[:9]), "The cat", ""]  # the first needs several rolling windows
    assert_same_answers(engine.loglikelihood_rolling(texts), ref.loglikelihood_rolling(texts))


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_engine_with_offloaded_tables_equals_reference_in_memory(tokens, tier, tmp_path):
    ref = ReferenceLM(make_model("stem"), tokens, 512, MAX_LENGTH)
    model = make_model("stem")
    tables_file = tmp_path / "tables.safetensors" if tier == "disk" else None
    store = offload_tables(model, Placement(tier, tables_file=tables_file, cache_rows=16))
    engine = EvalEngine(model, tokens, max_length=MAX_LENGTH, batch_size=5)
    reqs = requests(tokens)
    assert_same_answers(engine.loglikelihood(reqs), ref.loglikelihood(reqs))
    assert engine.generate_until(gen_requests()) == ref.generate_until(gen_requests())
    stats = store.stats()
    assert stats["lookups"] > 0 and stats["prefetched"] > 0  # rows came through the store's prefetch
    store.close()


def test_each_context_runs_once_and_no_gradients(tokens, monkeypatch):
    model = make_model("stem")
    engine = EvalEngine(model, tokens, max_length=MAX_LENGTH, batch_size=64)
    seen = []
    real = model.forward
    monkeypatch.setattr(model, "forward", lambda ids, **kw: seen.append(ids.clone()) or real(ids, **kw))
    reqs = [LoglikelihoodRequest("The capital of France is", c) for c in (" Paris", " four.", " the mat", " a")]
    out = engine.loglikelihood(reqs)
    ctx_len = len(tokens.encode("The capital of France is")) + 1
    n_choice_tokens = sum(len(tokens.encode("The capital of France is" + r.continuation)) + 1 - ctx_len - 1 for r in reqs)
    assert len(seen) == 1 and seen[0].shape == (1, ctx_len + n_choice_tokens)  # one row: the context once
    assert all(isinstance(o.logprob, float) for o in out)
    assert not torch.is_grad_enabled() or all(p.grad is None for p in model.parameters())


def test_bad_requests_are_clear_errors(tokens):
    engine = EvalEngine(make_model("dense"), tokens, max_length=8)
    with pytest.raises(ValueError, match="longer than max_length=8"):
        engine.loglikelihood([LoglikelihoodRequest("a", " " + " ".join(TEXTS[:3]))])
    small = EvalEngine(StemLM(model_config("debug", vocab_size=64)).eval(), tokens, max_length=8)
    with pytest.raises(ValueError, match="beyond the model's vocabulary of 64"):
        small.loglikelihood([LoglikelihoodRequest("The capital", " of France")])
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        EvalEngine(make_model("dense"), tokens, batch_size=0)


def test_rolling_windows_are_the_harness_windows():
    utils = pytest.importorskip("lm_eval.utils")
    from stemlm.eval.api import rolling_windows

    gen = torch.Generator().manual_seed(0)
    for max_length in (1, 2, 3, 8):
        for n in range(0, 30):
            ids = torch.randint(0, 100, (n,), generator=gen).tolist()
            want = [utils.make_disjoint_window(w) for w in utils.get_rolling_token_windows(ids, 999, max_length, 1)]
            assert rolling_windows(ids, 999, max_length) == want
