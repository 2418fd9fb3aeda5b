"""Activation patching at the subject's tokens (stemlm.edit.trace) on a tiny dense model."""

import pytest
import torch

from stemlm import model_config
from stemlm.edit.probes import Probe
from stemlm.edit.trace import Case, patch_effects, subject_span
from stemlm.model.decoder import StemLM


def _cases(model, prompts: list[tuple[list[int], list[int]]]) -> list[Case]:
    """Cases whose answers are the model's own top-1 tokens (so each fact is 'known')."""
    def probe(name, ids):
        with torch.no_grad():
            top = int(model(torch.tensor([ids]))[0, -1].argmax())
        return Probe(name, "capital", 0, name, "", tuple(ids), (top,))
    out = []
    for a, b in prompts:
        pa, pb = probe("A", a), probe("B", b)
        if pa.answer_ids[0] != pb.answer_ids[0]:
            out.append(Case(pa, pb, subject_span(a, b)))
    return out


@pytest.fixture
def model_and_cases():
    model = StemLM(model_config("debug", ffn="dense")).eval()
    g = torch.Generator().manual_seed(0)
    prompts = []
    for length in (6, 6, 7, 9, 9, 9):
        a = torch.randint(0, model.cfg.vocab_size, (length,), generator=g).tolist()
        b = list(a)
        b[2] = (a[2] + 17) % model.cfg.vocab_size  # the "country" token
        prompts.append((a, b))
    cases = _cases(model, prompts)
    assert len(cases) >= 3
    return model, cases


def test_subject_span_is_where_the_prompts_differ():
    assert subject_span([1, 2, 3, 4], [1, 5, 6, 4]) == (1, 3)
    assert subject_span([1, 2], [1, 2]) is None and subject_span([1, 2], [1, 2, 3]) is None


def test_patching_the_input_embedding_turns_the_prompt_into_the_other(model_and_cases):
    """The residual stream entering layer 0 at the span is the other token's embedding: the patched run
    is the other prompt's run, so every case flips and p(other answer) is the other run's own."""
    model, cases = model_and_cases
    res = patch_effects(model, cases, "resid", {"embedding": [0]})["embedding"]
    assert res["flip"] == 1.0 and res["keeps"] == 0.0 and res["cases"] == len(cases)
    with torch.no_grad():
        own = [torch.softmax(model(torch.tensor([c.other.prompt_ids]))[0, -1], -1)[c.other.answer_ids[0]]
               for c in cases]
    assert res["p_other"] == pytest.approx(float(torch.stack(own).mean()), rel=1e-5)


def test_no_patched_layer_changes_nothing_and_patches_reach_the_output(model_and_cases):
    model, cases = model_and_cases
    layers = list(range(model.cfg.n_layers))
    res = patch_effects(model, cases, "up", {"none": [], "all": layers})
    assert res["none"]["flip"] == 0.0 and res["none"]["keeps"] == 1.0
    assert res["none"]["p_other"] == pytest.approx(res["none"]["p_other_before"], rel=1e-6)
    assert res["all"]["p_other"] != pytest.approx(res["all"]["p_other_before"], rel=1e-3)
    ffn = patch_effects(model, cases, "ffn", {"all": layers})["all"]
    assert ffn["p_other"] != pytest.approx(res["all"]["p_other"], rel=1e-3)


def test_patch_kind_and_site_are_checked(model_and_cases):
    model, cases = model_and_cases
    with pytest.raises(ValueError, match="unknown patch kind 'down'"):
        patch_effects(model, cases, "down", {"x": [0]})
    stem = StemLM(model_config("debug", ffn="stem", stem_layers="full")).eval()
    with pytest.raises(ValueError, match=r"layer 1 \(stem\) has no up-projection"):
        patch_effects(stem, cases, "up", {"x": [1]})
    assert patch_effects(model, [], "up", {"x": [0]})["x"]["cases"] == 0
