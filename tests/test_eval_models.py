"""Loading models for evaluation: stemlm checkpoints on every tier, Llama directories, tokenization, identity."""

import pytest
import torch

from stemlm import StemLM, model_config
from stemlm.checkpoint.directory import save_model
from stemlm.interop.convert import llama_to_stem
from stemlm.data.tokenizer import train_bpe
from stemlm.eval import models as eval_models
from stemlm.eval.api import GenerateRequest, LoglikelihoodRequest, ReferenceLM, encode_pair
from stemlm.eval.models import load_lm
from test_hf import llama_dir

TEXTS = ["The capital of France is Paris.", "A dog ran in the park.", "Tables hold one row per token."] * 20
REQUESTS = [LoglikelihoodRequest("The capital of France is", " Paris"), LoglikelihoodRequest("", "A dog"),
            LoglikelihoodRequest("A dog ran in the ", "park.")]


@pytest.fixture(autouse=True)
def _private_digest_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(eval_models, "DIGEST_CACHE", tmp_path / "digests.json")


@pytest.fixture(scope="module")
def stem_ckpt(tmp_path_factory):
    """A debug STEM checkpoint with a stemlm BPE tokenizer."""
    torch.manual_seed(0)
    model = StemLM(model_config("debug", ffn="stem", stem_layers="1/2")).eval()
    path = tmp_path_factory.mktemp("eval_models") / "ckpt"
    save_model(model, path)
    train_bpe(TEXTS, vocab_size=300).save(str(path / "tokenizer.json"))
    return model, path


def test_stem_checkpoint_on_every_tier_gives_the_same_answers(stem_ckpt):
    model, path = stem_ckpt
    lms = {tier: load_lm(path, tier, engine="reference") for tier in ("device", "host", "disk")}
    assert lms["device"].tokens.prefix_ids == [lms["device"].tokens.eot_id]  # the document-start token
    want = lms["device"].loglikelihood(REQUESTS)
    direct = ReferenceLM(model, lms["device"].tokens, 512, 128).loglikelihood(REQUESTS)
    assert want == direct
    for tier in ("host", "disk"):
        got = lms[tier].loglikelihood(REQUESTS)
        assert [g.n_tokens for g in got] == [w.n_tokens for w in want]
        torch.testing.assert_close([g.logprob for g in got], [w.logprob for w in want], rtol=0, atol=1e-5)
    assert len({lm.identity for lm in lms.values()}) == 1  # the tier does not change the model


def test_identity_follows_weights_and_settings(stem_ckpt, tmp_path):
    model, path = stem_ckpt
    first = load_lm(path, engine="reference").identity
    assert load_lm(path, engine="reference").identity == first
    assert load_lm(path, engine="reference", dtype="bfloat16").identity != first
    with torch.no_grad():
        model.tables["1"].weight[[5, 6]] = model.tables["1"].weight[[6, 5]].clone()  # a row swap
    save_model(model, tmp_path / "edited")
    (tmp_path / "edited" / "tokenizer.json").write_bytes((path / "tokenizer.json").read_bytes())
    assert load_lm(tmp_path / "edited", engine="reference").identity != first
    with torch.no_grad():
        model.tables["1"].weight[[5, 6]] = model.tables["1"].weight[[6, 5]].clone()


def test_llama_directory_tokenizes_as_the_harness(tmp_path):
    llama, path = llama_dir(tmp_path)
    lm = load_lm(path, engine="reference")
    tok = lm.tokens
    assert tok.hf and tok.prefix_ids == [] and tok.eot_id == 1  # BOS, like lm-eval's prefix token
    ctx, cont = encode_pair(tok, "the cat sat on the ", "mat")
    assert ctx == tok.tokenizer.encode("the cat sat on the") and ctx + cont == tok.tokenizer.encode("the cat sat on the mat")
    assert encode_pair(tok, "", "the cat")[0] == [1]
    ids = torch.tensor([ctx + cont])
    with torch.no_grad():
        torch.testing.assert_close(lm.model(ids), llama_to_stem(llama)(ids), rtol=0, atol=1e-5)
    fast = load_lm(path, batch_size=2)  # the engine with HF tokens: same answers, stops at EOS
    reqs = [LoglikelihoodRequest("the cat sat on the ", "mat"), LoglikelihoodRequest("", "a dog ran")]
    for got, want in zip(fast.loglikelihood(reqs), lm.loglikelihood(reqs)):
        assert got.n_tokens == want.n_tokens and abs(got.logprob - want.logprob) <= 1e-4
    gens = [GenerateRequest("the cat", ("park",), 5), GenerateRequest("", (), 4), GenerateRequest("a dog ran in", (), 6)]
    assert fast.generate_until(gens) == lm.generate_until(gens)


@pytest.mark.slow
def test_pinned_smollm2_gguf_knows_paris():
    """~36 s: the GGUF dequantised by transformers, converted exactly, scored by the engine."""
    lm = load_lm("smollm2", batch_size=4)
    assert lm.tokens.prefix_ids == [] and lm.max_length == lm.model.cfg.max_seq_len
    paris, rome = lm.loglikelihood([LoglikelihoodRequest("The capital of France is", " Paris"),
                                    LoglikelihoodRequest("The capital of France is", " Rome")])
    assert paris.is_greedy and paris.logprob > rome.logprob
    assert lm.generate_until([GenerateRequest("The capital of France is", ("\n", "."), 8)])[0].startswith(" Paris")


def test_bad_inputs_are_one_line_errors(stem_ckpt, tmp_path):
    _, path = stem_ckpt
    with pytest.raises(ValueError, match="unknown table tier 'ram'"):
        load_lm(path, "ram")
    with pytest.raises(ValueError, match="unknown engine"):
        load_lm(path, engine="turbo")
    small = tmp_path / "small"
    save_model(StemLM(model_config("debug", vocab_size=64)), small)
    (small / "tokenizer.json").write_bytes((path / "tokenizer.json").read_bytes())
    with pytest.raises(ValueError, match="tokenizer has 300 tokens but the model's vocabulary has 64 rows"):
        load_lm(small)
    save_model(StemLM(model_config("debug")), tmp_path / "bare")
    with pytest.raises(FileNotFoundError, match="no tokenizer"):
        load_lm(tmp_path / "bare")
