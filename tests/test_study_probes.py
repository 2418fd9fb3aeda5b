"""The study's probes can succeed: positive controls (a model trained on the facts; a model that copies)
and negative ones (an untrained model; a model that ignores its context)."""

import pytest
import torch
from train_helpers import one_thread  # noqa: F401

from pathlib import Path

from stemlm.data import load_facts, prepare_default_corpus, prepare_facts_corpus, write_token_split
from stemlm.data.facts import fact_documents
from stemlm.data.tokenizer import encode_batch, eos_id_of, load_tokenizer
from stemlm.eval.api import Loglikelihood
from stemlm.eval.tasks.needle import needle_trials
from stemlm.study.probes import (DECOY, decoy_items, knowledge_items, knowledge_probe, lm_for, needle_probe,
                                  needle_values, passkey_documents)
from stemlm.study.stats import Difference, verdict
from stemlm.train import Trainer, load_train_config


def _diff(d: dict) -> Difference:
    return Difference(**{**d, "ci": tuple(d["ci"]) if d["ci"] else None})


def test_knowledge_items_contrast_each_fact_with_a_never_trained_country():
    facts = load_facts(prepare_facts_corpus(progress=False))
    items = knowledge_items(facts)
    # held out: countries none of whose own facts is trained (a border list naming one is held out too)
    held = {f["country"] for f in facts if f["split"] == "heldout_country" and f["relation"] != "borders"}
    assert {it["family"] for it in items} == {"train", "heldout", "question"}
    assert {it["country"] for it in items if not it["seen"]} == held
    assert all(it["answer"].startswith(" ") for it in items)
    for it in items[::50]:
        partners = [h for h in held if it["prompt"].replace(it["country"], h) == it["partner_prompt"]]
        assert partners and it["country"] not in partners  # the same prompt about a never-trained country


def _small_fact_world(out: Path, n_seen: int = 20) -> list[dict]:
    """The held-out countries and ``n_seen`` trained ones, as a token data dir of their training facts."""
    src = prepare_facts_corpus(progress=False)
    facts = load_facts(src)
    held = {f["country"] for f in facts if f["split"] == "heldout_country" and f["relation"] != "borders"}
    seen = sorted({f["country"] for f in facts} - held)[:n_seen]
    world = [f for f in facts if f["country"] in held | set(seen)]
    tok = load_tokenizer(src / "tokenizer.json")
    out.mkdir(parents=True)
    tok.save(str(out / "tokenizer.json"))
    ids = list(encode_batch(tok, fact_documents(world, repeats=4), progress=False))
    write_token_split(out, "train", ids, tok.get_vocab_size(), eos_id_of(tok))
    write_token_split(out, "val", ids[:16], tok.get_vocab_size(), eos_id_of(tok))
    return world


def test_knowledge_probe_separates_a_model_trained_on_facts_from_an_untrained_one(tmp_path):
    """Positive control: a debug STEM model trained on the facts of a small world (the editing recipe) has a
    clearly positive seen − unseen contrast; at its init the contrast is nil."""
    world = _small_fact_world(tmp_path / "data")
    cfg = load_train_config("debug", None, [f"data.dir={tmp_path / 'data'}", f"run.out={tmp_path / 'run'}", "run.steps=80",
                                            "data.batch_size=16", "data.seq_len=64", "model.ffn=stem",
                                            "model.stem_layers=full", "optim.lr=1e-2", "optim.table_lr=0.1",
                                            "optim.embed_lr=0", "run.eval_every=0", "run.ckpt_every=80",
                                            "run.peak_flops=1e11", "run.progress=false", "run.plots=false"])
    trainer = Trainer(cfg)
    untrained = knowledge_probe(lm_for(trainer.model, tmp_path / "data"), world)
    trainer.fit()
    trained = knowledge_probe(lm_for(trainer.model, tmp_path / "data"), world)
    trainer.close()
    before, after = (_diff(p["families"]["train"]["seen_minus_unseen"]) for p in (untrained, trained))
    assert verdict(after, +1) == "holds" and after.mean > 0.1  # it stored what it read
    assert verdict(before, +1) != "holds" and abs(before.mean) < 0.02  # at init there is nothing to see
    limited = knowledge_probe(lm_for(trainer.model, tmp_path / "data"), world, limit=10)
    assert limited["families"]["train"]["n_seen"] == limited["families"]["train"]["n_unseen"] == 10


class _ContextLM:
    """An analytic stand-in: ``copy`` makes any continuation likely whose text occurs in the context (the
    repetition every language model learns early); ``retrieve`` only the number the pass key names
    (greedy then gives it)."""

    max_length, identity = 512, "fake"

    def __init__(self, mode: str):
        self.mode = mode

    def loglikelihood(self, requests):
        out = []
        for r in requests:
            key = r.continuation.strip()
            hit = {"copy": key in r.context, "retrieve": f"pass key is {key}." in r.context}.get(self.mode, False)
            out.append(Loglikelihood(-12.0 + (9.0 if hit else 0.0) - 0.001 * len(r.context) / 100,
                                     max(1, len(r.continuation) // 4), hit and self.mode == "retrieve"))
        return out


def test_needle_probe_tells_retrieval_from_repetition():
    copy, retrieve, blind = (needle_probe(_ContextLM(m), trials=2, seed=0) for m in ("copy", "retrieve", "blind"))
    assert copy["lengths"] == [64, 128, 256, 512] and copy["version"] == 2
    # repetition: the needle's gain is large, but the decoy is in the context too, so no margin
    assert copy["mean_gain"]["mean"] == pytest.approx(9.0, abs=0.01)
    assert abs(copy["mean_margin"]["mean"]) < 0.01 and verdict(_diff(copy["mean_margin"]), +1) != "holds"
    assert copy["retrieved"]["mean"] == 0.0
    # retrieval: the key over the decoy at every depth and length, and greedy finds it
    assert verdict(_diff(retrieve["mean_margin"]), +1) == "holds"
    assert all(m == pytest.approx(9.0, abs=0.01) for row in retrieve["margin"] for m in row)
    assert retrieve["retrieved"] == {"mean": 1.0, "n": 40}
    assert abs(blind["mean_margin"]["mean"]) < 0.01 and abs(blind["mean_gain"]["mean"]) < 0.01
    assert verdict(_diff(blind["mean_margin"]), +1) != "holds" and blind["retrieved"]["mean"] == 0.0


def test_needle_probe_puts_a_decoy_of_the_needles_shape_in_every_context():
    lm = _ContextLM("blind")
    _, _, items = needle_trials(lm, 2, 0, extra=DECOY.format(key=12345))
    items = decoy_items(items, 0)
    for it in items:
        assert it["decoy"] != it["key"]
        assert it["both"].count(str(it["key"])) == 2 and it["both"].count(str(it["decoy"])) == 2
        assert str(it["key"]) not in it["decoy_only"] and it["decoy_only"].count(str(it["decoy"])) == 2
    assert decoy_items(items, 0) == decoy_items(items, 0)  # seeded


def test_one_token_keys_are_one_token_each_and_the_probe_retrieves_them():
    data = prepare_default_corpus(progress=False)  # the study's corpus
    tok = load_tokenizer(data / "tokenizer.json")
    for kind in ("token-number", "token-word"):
        values = needle_values(kind, data / "tokenizer.json")
        assert len(values) >= 20 and all(len(tok.encode(" " + v).ids) == 1 for v in values)
        probe = needle_probe(_ContextLM("retrieve"), trials=1, seed=0, values=values)
        assert probe["key"] == f"one of {len(values)} one-token keys" and probe["retrieved"]["mean"] == 1.0
        assert verdict(_diff(probe["mean_margin"]), +1) == "holds"
        docs = passkey_documents(4, 600, seed=0, values=values)
        assert all(d.rsplit(" ", 1)[1].rstrip(".") in values for d in docs)
    assert needle_values("number", data / "tokenizer.json") is None
    with pytest.raises(ValueError, match="choose one of number, token-number, token-word"):
        needle_values("letters", data / "tokenizer.json")


def test_passkey_documents_end_with_the_key_of_their_needle_and_hold_a_decoy():
    docs = passkey_documents(5, 1200, seed=1)
    for d in docs:
        key = d.rsplit(" ", 1)[1].rstrip(".")
        assert f"The pass key is {key}." in d and d.endswith(f"The pass key is {key}.")
        assert "The room number is " in d
    assert passkey_documents(5, 1200, seed=1) == docs


def test_probes_on_an_engine_over_a_real_model_are_finite(tmp_path):
    from stemlm.model.decoder import StemLM
    from stemlm.presets import model_config

    data = prepare_facts_corpus(progress=False)
    torch.manual_seed(0)
    model = StemLM(model_config("debug", ffn="stem", vocab_size=4096, max_seq_len=256))
    probe = needle_probe(lm_for(model, data), trials=1, lengths=[128, 256])
    assert probe["lengths"] == [128, 256] and all(abs(g) < 50 for row in probe["gain"] for g in row)


def test_a_spec_with_an_unknown_needle_key_is_refused_in_one_line(tmp_path):
    from stemlm.config import ConfigError
    from stemlm.study.spec import load_spec

    text = (Path(__file__).resolve().parents[1] / "studies" / "quick.yaml").read_text()
    bad = tmp_path / "bad.yaml"
    bad.write_text(text.replace("key: token-number", "key: letters"))
    with pytest.raises(ConfigError, match="probes.needle.key='letters'; choose one of number, token-number, token-word"):
        load_spec(bad)
