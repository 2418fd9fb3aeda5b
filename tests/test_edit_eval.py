"""Edit evaluation, reports, CLIs and tiers on a tiny model with synthetic country facts."""

import json

import pytest
import torch

from stemlm import StemLM, model_config
from stemlm.checkpoint.directory import save_model
from stemlm.cli import main
from stemlm.data.facts import Country, build_facts, write_facts
from stemlm.data.tokenizer import train_bpe
from stemlm.edit import entity_ids, forget, swap
from stemlm.edit.evaluate import EditEvalConfig, EditEvaluator, layer_sweep, run_edit_eval
from stemlm.edit.probes import build_probes
from stemlm.edit.report import edit_report, format_report, plot_report, swap_report
from stemlm.edit.scoring import score

NAMES = ["Spain", "Germany", "France", "Italy", "Peru", "Chile", "Kenya", "Japan"]
CAPITALS = ["Madrid", "Berlin", "Paris", "Rome", "Lima", "Santiago", "Nairobi", "Tokyo"]
LANGS = ["Spanish", "German", "French", "Italian", "Quechua", "Mapuche", "Swahili", "Japanese"]


@pytest.fixture(scope="module")
def world():
    countries = [Country(n, n[:3].upper(), capital=c, language=lang) for n, c, lang in zip(NAMES, CAPITALS, LANGS)]
    facts = build_facts(countries, heldout_fraction=0)
    extra = [" " + w for w in NAMES + CAPITALS] + [" United States"]
    tok = train_bpe([f["text"] for f in facts] * 2, vocab_size=420, extra_tokens=extra[:-1])
    return facts, tok


@pytest.fixture
def model(world):
    return StemLM(model_config("debug", vocab_size=world[1].get_vocab_size(), stem_layers="full")).eval()


def test_padded_scoring_equals_single_sequences(model):
    prompts, answers = [[0, 5, 6, 7], [0, 9], [0, 3, 4, 5, 6, 7, 8]], [[11, 12], [13], [14, 15, 16]]
    got = score(model, prompts, answers)
    for i, (p, a) in enumerate(zip(prompts, answers)):
        with torch.no_grad():
            logits = model(torch.tensor([p + a]))[0]
        torch.testing.assert_close(got.last_logits[i], logits[len(p) - 1], rtol=1e-5, atol=1e-5)
        hits = logits[len(p) - 1:-1].argmax(-1) == torch.tensor(a)
        assert bool(got.first_ok[i]) == bool(hits[0]) and bool(got.full_ok[i]) == bool(hits.all())


def test_evaluation_is_reversible_and_local(world, model):
    facts, tok = world
    cfg = EditEvalConfig(split="train", n_pairs=2, n_locality=8, layer_sets=layer_sweep(model))
    res = run_edit_eval(model, tok, facts, cfg, progress=False)
    assert [r["layers_label"] for r in res["runs"]] == ["all", "first1", "last1", "first2", "last2"]
    for run in res["runs"]:
        assert run["reversible"] == 1.0 and run["edits"] == 2
        assert run["locality_top1"] == 1.0 and run["locality_kl"] == 0.0  # single-token names: other prompts untouched
        assert run["locality_known"] in (1.0, None) and run["locality_known_n"] <= run["locality_n"]
        # a prompt holding none of the edited names' tokens reads no edited row: exactly unchanged
        assert run["locality_disjoint"] == 1.0 and run["locality_disjoint_n"] + run["locality_shared_n"] == run["locality_n"]
        assert run["cases"] > 0


def test_success_metric_matches_an_exact_identity_transplant(world, model):
    """Equal input embeddings for the country tokens make a swap over all table layers an exact
    transplant: after it, A's prompt behaves like B's prompt, so (with knowledge forced) success
    must equal the fraction of B's prompts whose top-1 is B's answer."""
    facts, tok = world
    ids = [entity_ids(tok, n)[0] for n in NAMES]
    with torch.no_grad():
        model.tok_embeddings.weight[ids] = model.tok_embeddings.weight[ids[0]].clone()
    ev = EditEvaluator(model, tok, facts, EditEvalConfig(split="train", n_pairs=3, n_locality=4, mode="copy"))
    ev.known = {k: (True, True) for k in ev.known}
    res = ev.run("auto", None)
    probes = build_probes(facts, tok, "train")
    expected, total = 0, 0
    for a, b in ev.pairs:
        same_q = {p.key: p for p in probes[b]}
        for p in probes[a]:
            q = same_q.get(p.key)
            if q is not None and q.answer_ids[0] != p.answer_ids[0]:
                total += 1
                expected += bool(score(model, [q.prompt_ids], [q.answer_ids]).first_ok[0])
    assert res["known"] == total > 0 and res["success"] == pytest.approx(expected / total)


def test_entity_strings_use_a_leading_space(world, model):
    facts, tok = world
    assert entity_ids(tok, "Spain") == entity_ids(tok, " Spain") != entity_ids(tok, "Spain", leading_space=False)
    assert len(entity_ids(tok, "Spain")) == 1 and len(entity_ids(tok, "United States")) > 1
    with pytest.raises(ValueError, match="empty"):
        entity_ids(tok, "  ")
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        entity_ids(tok, "Spain", vocab_size=10)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with swap(model, "Spain", "United States", strategy="filler", align="right", tokenizer=tok) as rec:
        assert "Spain" in rec.description and sum(len(ids) for ids, _ in rec.old.values()) > 3
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


def test_reports_and_plot(world, model, tmp_path):
    facts, tok = world
    rep = swap_report(model, tok, "The capital of Spain is", "Spain", "Germany", k=3, mode="swap")
    assert [p.label.split(",")[0] for p in rep.panels] == ["original model", "original model", "edited model"]
    assert rep.panels[1].prompt == "The capital of Germany is" and len(rep.panels[2].probs) == 3
    assert "| rank | token | prob |" in format_report(rep)
    assert plot_report(rep, tmp_path / "r.png").stat().st_size > 0
    rep2 = edit_report(model, tok, "The capital of Peru is", lambda: forget(model, "Spain", tokenizer=tok), k=2,
                       source="Spain")
    assert len(rep2.panels) == 2 and rep2.warnings  # Spain is not in the prompt
    with pytest.raises(ValueError, match="does not mention"):
        swap_report(model, tok, "The capital of Peru is", "Spain", "Germany")


@pytest.fixture
def ckpt_and_data(world, model, tmp_path):
    facts, tok = world
    data = tmp_path / "data"
    write_facts(data / "facts" / "facts.jsonl", facts)
    tok.save(str(data / "tokenizer.json"))
    save_model(model, tmp_path / "ckpt", tokenizer_dir=data)
    return tmp_path / "ckpt", data


def test_edit_cli(ckpt_and_data, tmp_path, capsys):
    ckpt, data = ckpt_and_data
    before = (ckpt / "model.safetensors").read_bytes()
    assert main(["edit", "--ckpt", str(ckpt), "--swap", "Spain=Germany", "--prompt", "The capital of Spain is",
                 "--top-k", "3", "--plot", str(tmp_path / "e.png"), "--json", str(tmp_path / "e.json")]) == 0
    assert "edited model, original prompt" in capsys.readouterr().out
    assert (tmp_path / "e.png").exists() and len(json.loads((tmp_path / "e.json").read_text())) == 1
    assert (ckpt / "model.safetensors").read_bytes() == before  # edits never reach the checkpoint
    assert main(["edit", "--ckpt", str(ckpt), "--swap", "Spain=Germany", "--prompt", "x", "--layers", "9"]) == 2
    assert "out of range" in capsys.readouterr().err
    assert main(["edit", "--ckpt", str(ckpt), "--swap", "Spain", "--prompt", "x"]) == 2


def test_edit_eval_cli(ckpt_and_data, tmp_path):
    ckpt, data = ckpt_and_data
    out = tmp_path / "res.json"
    assert main(["edit-eval", "--ckpt", str(ckpt), "--data", str(data), "--split", "train", "--pairs", "3",
                 "--strategies", "auto,clone", "--locality", "8", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert [r["strategy"] for r in res["runs"]] == ["auto", "clone"] and res["runs"][0]["reversible"] == 1.0


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_edits_on_offloaded_tiers_equal_in_memory(ckpt_and_data, tier):
    from stemlm.edit.load import load_model_and_tokenizer

    ckpt, data = ckpt_and_data
    ref, tok = load_model_and_tokenizer(ckpt)
    off, _ = load_model_and_tokenizer(ckpt, placement=tier)
    ids = torch.tensor([[0] + entity_ids(tok, "The capital of Spain is", leading_space=False)])
    with torch.no_grad():
        base = off(ids)
        with swap(ref, "Spain", "United States", strategy="average", tokenizer=tok), \
                swap(off, "Spain", "United States", strategy="average", tokenizer=tok):
            torch.testing.assert_close(off(ids), ref(ids), rtol=0, atol=0)
            assert not torch.equal(off(ids), base)
        assert torch.equal(off(ids), base)


def test_injection_and_forget_evaluations(world, model):
    from stemlm.edit.inject_eval import _replace, run_forget, run_injection, unused_tokens

    facts, tok = world
    assert _replace((0, 5, 6, 7), [6], [8, 9]) == (0, 5, 8, 9, 7)
    with pytest.raises(ValueError, match="do not occur"):
        _replace((0, 5), [6], [8])
    counts = torch.zeros(tok.get_vocab_size(), dtype=torch.long).numpy()
    counts[: tok.get_vocab_size() // 2] = 1
    unused = unused_tokens(counts, tok, 3)
    assert all(counts[t] == 0 and tok.decode([t]).startswith(" ") for t in unused)
    text = torch.randint(0, tok.get_vocab_size(), (2, 16))
    ev = EditEvaluator(model, tok, facts, EditEvalConfig(split="train", n_pairs=1, n_locality=8), text=text)
    ev.known = {k: (True, True) for k in ev.known}  # a random model knows nothing: force the filter open
    res = run_injection(ev, {"Atlantis": entity_ids(tok, "Atlantis")}, strategy="filler", align="right")
    assert res["known"] > 0 and res["reversible"] == 1.0 and res["entities"] == 1
    assert 0 <= res["text_locality_top1"] <= 1 and res["text_locality_kl"] >= 0
    gone = run_forget(ev, ["Spain", "Peru"], replacement="mean", layers=[2])
    assert gone["known"] > 0 and gone["reversible"] == 1.0 and gone["locality_top1"] == 1.0
