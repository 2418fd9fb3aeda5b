"""Knowledge-edit API: exact undo, context manager, strategies' row math, locality, clean errors."""

import pytest
import torch

from stemlm import StemLM, model_config
from stemlm.edit import copy, edit, forget, map_rows, plan, source_index_map, swap, undo_all
from stemlm.edit.rows import EditRecord


@pytest.fixture
def model():
    return StemLM(model_config("debug", ffn="stem", stem_layers="full")).eval()


def _state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def _same_state(model, state):
    return all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


def _logits(model, ids):
    with torch.no_grad():
        return model(ids)


def test_swap_exchanges_rows_in_every_layer_and_undo_is_bitwise(model):
    ids = torch.randint(0, 200, (2, 12))
    ids[0, 4], ids[1, 7] = 300, 301
    before, state = _logits(model, ids), _state(model)
    rows = {k: t.weight.detach()[[300, 301]].clone() for k, t in model.tables.items()}
    record = swap(model, [300], [301])
    for k, t in model.tables.items():
        assert torch.equal(t.weight[300], rows[k][1]) and torch.equal(t.weight[301], rows[k][0])
    assert not torch.equal(_logits(model, ids), before)
    record.undo()
    assert torch.equal(_logits(model, ids), before) and _same_state(model, state)
    record.undo()  # idempotent
    assert _same_state(model, state)


def test_context_manager_restores_on_exit_and_on_error(model):
    ids = torch.tensor([[1, 2, 300, 4, 5]])
    before = _logits(model, ids)
    with copy(model, [301], [300]) as record:
        assert isinstance(record, EditRecord) and record.layers == [1, 2, 3]
        assert not torch.equal(_logits(model, ids), before)
    assert torch.equal(_logits(model, ids), before)
    with pytest.raises(RuntimeError):
        with swap(model, [300], [301]):
            raise RuntimeError("boom")
    assert torch.equal(_logits(model, ids), before)


def test_copy_touches_only_chosen_layers_and_destination(model):
    state = _state(model)
    with copy(model, [10], [20], layers=[2]):
        assert torch.equal(model.tables["2"].weight[20], state["tables.2.weight"][10])
        assert torch.equal(model.tables["2"].weight[10], state["tables.2.weight"][10])  # source unchanged
        for k in ("1", "3"):
            assert torch.equal(model.tables[k].weight, state[f"tables.{k}.weight"])
    assert _same_state(model, state)


def test_swap_over_all_layers_transplants_identity_exactly(model):
    """With equal input embeddings, tokens differ only by their table rows: after swapping
    them everywhere, a prompt with token a behaves exactly like the original prompt with b."""
    with torch.no_grad():
        model.tok_embeddings.weight[300] = model.tok_embeddings.weight[301]
    prompt_a = torch.tensor([[5, 6, 300, 7]])
    prompt_b = torch.tensor([[5, 6, 301, 7]])
    expected = _logits(model, prompt_b)
    with swap(model, [300], [301]):
        torch.testing.assert_close(_logits(model, prompt_a), expected, rtol=0, atol=0)


def test_edit_leaves_logits_before_first_occurrence_unchanged(model):
    ids = torch.randint(0, 200, (1, 16))
    p = 9
    ids[0, p] = 400
    before = _logits(model, ids)
    with swap(model, [400], [401]):
        after = _logits(model, ids)
    assert torch.equal(before[:, :p], after[:, :p])
    assert (before[:, p:] - after[:, p:]).abs().max() > 1e-5


@pytest.mark.parametrize("strategy, align, n, m, expected", [
    ("one_to_one", "left", 2, 2, [0, 1]),
    ("filler", "left", 3, 1, [0, None, None]),
    ("filler", "right", 3, 1, [None, None, 0]),
    ("filler", "left", 1, 3, [0]),
    ("filler", "right", 1, 3, [2]),
    ("clone", "left", 3, 2, [0, 1, 1]),
    ("clone", "right", 3, 2, [0, 0, 1]),
    ("clone", "left", 2, 3, [0, 1]),
    ("clone", "right", 2, 3, [1, 2]),
])
def test_strategy_index_maps(strategy, align, n, m, expected):
    assert source_index_map(strategy, n, m, align) == expected


def test_strategy_rows():
    target = torch.randn(3, 8)
    filler = torch.randn(8)
    assert torch.equal(map_rows(target, 2, "average"), target.mean(0).expand(2, 8))
    assert torch.equal(map_rows(target, 4, "filler", "left", filler), torch.stack([*target, filler]))
    assert torch.equal(map_rows(target, 4, "clone", "right"), torch.stack([target[0], *target]))
    assert torch.equal(map_rows(target, 3, "auto"), target)
    assert torch.equal(map_rows(target, 1, "auto"), target.mean(0, keepdim=True))
    with pytest.raises(ValueError, match="equal lengths"):
        map_rows(target, 2, "one_to_one")


def test_unequal_length_swap_writes_strategy_rows(model):
    t = model.tables["1"].weight.detach().clone()
    with swap(model, [50], [60, 61], strategy="filler", align="right", filler=0, layers=[1]):
        w = model.tables["1"].weight
        assert torch.equal(w[50], t[61])  # last target row on the source's last token
        assert torch.equal(w[60], t[0]) and torch.equal(w[61], t[50])  # target padded on the left


def test_kept_ids_are_not_written(model):
    """keep= leaves the rows of shared subwords: " United States" <-> " Germany" edits " States" only."""
    state = _state(model)
    with swap(model, [7, 8], [20], strategy="average", keep=[7], layers=[1]):
        w, t = model.tables["1"].weight, state["tables.1.weight"]
        assert torch.equal(w[7], t[7]) and torch.equal(w[8], t[20])
        assert torch.equal(w[20], (t[7] + t[8]) / 2)  # the other way still reads the kept token's row
    assert _same_state(model, state)
    assert plan(model, [7], [9], keep=[7, 9], mode="swap") == {}  # nothing left to write


def test_shared_token_conflict_is_an_error_and_model_unchanged(model):
    state = _state(model)
    # " United States" <-> " United Kingdom": one_to_one is consistent (shared token keeps its row) ...
    with swap(model, [7, 8], [7, 9], strategy="one_to_one"):
        assert torch.equal(model.tables["1"].weight[8], state["tables.1.weight"][9])
    # ... averaging would give the shared token two different rows.
    with pytest.raises(ValueError, match="two different rows"):
        swap(model, [7, 8], [7, 9], strategy="average")
    assert _same_state(model, state)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(layers=[7]), IndexError, "out of range"),
    (dict(layers=[0]), ValueError, "has no table"),
    (dict(strategy="nope"), ValueError, "unknown strategy"),
    (dict(mode="move"), ValueError, "unknown mode"),
])
def test_bad_edit_arguments_leave_model_unchanged(model, kwargs, error, match):
    state = _state(model)
    with pytest.raises(error, match=match):
        edit(model, [3], [4], **kwargs)
    assert _same_state(model, state)


def test_bad_ids_and_models_without_tables():
    model = StemLM(model_config("debug", ffn="stem", stem_layers="1/2")).eval()
    state = _state(model)
    with pytest.raises(IndexError, match="token id 512 out of range"):
        swap(model, [3], [512])
    with pytest.raises(ValueError, match="empty"):
        swap(model, [], [3])
    with pytest.raises(ValueError, match="is a string but no tokenizer"):
        swap(model, "Spain", "Germany")
    with pytest.raises(ValueError, match="needs filler"):
        swap(model, [3], [4, 5], strategy="filler")
    assert _same_state(model, state)
    with pytest.raises(ValueError, match="no table layers"):
        swap(StemLM(model_config("debug", ffn="dense")), [3], [4])


def test_failed_write_rolls_back(model, monkeypatch):
    state = _state(model)
    table = model.tables["3"]

    def broken(ids, rows):
        raise OSError("disk full")
    monkeypatch.setattr(table, "write_rows", broken)
    with pytest.raises(OSError):
        swap(model, [3], [4])
    monkeypatch.undo()
    assert _same_state(model, state)


def test_plan_writes_nothing(model):
    state = _state(model)
    writes = plan(model, [3, 4], [5], strategy="average", layers=[1, 3])
    assert sorted(writes) == [1, 3] and writes[1][0].tolist() == [3, 4]
    assert _same_state(model, state)


def test_forget_writes_mean_row_and_undo_all(model):
    state = _state(model)
    r1 = forget(model, [42], replacement="mean")
    for k, t in model.tables.items():
        torch.testing.assert_close(t.weight[42], state[f"tables.{k}.weight"].mean(0))
    r2 = forget(model, [43], replacement=[1, 2], layers=[2])
    torch.testing.assert_close(model.tables["2"].weight[43], state["tables.2.weight"][[1, 2]].mean(0))
    r3 = forget(model, [42], replacement="zero")
    assert model.tables["1"].weight[42].abs().sum() == 0
    undo_all([r1, r2, r3])
    assert _same_state(model, state)


def test_embedding_diagnostic_edit_is_exact_and_complete(model):
    """Swapping the embedding rows as well as every table row makes token a behave exactly like b."""
    state = _state(model)
    prompt_a, prompt_b = torch.tensor([[5, 6, 300, 7]]), torch.tensor([[5, 6, 301, 7]])
    expected = _logits(model, prompt_b)
    with swap(model, [300], [301], embedding=True) as rec:
        assert rec.layers == [1, 2, 3, "embedding"]
        torch.testing.assert_close(_logits(model, prompt_a), expected, rtol=0, atol=0)
    assert _same_state(model, state)
    with swap(model, [300], [301], layers=[], embedding=True) as rec:  # the embedding alone
        assert rec.layers == ["embedding"] and torch.equal(model.tables["1"].weight, state["tables.1.weight"])
    assert _same_state(model, state)
    with pytest.raises(ValueError, match="tied embeddings"):
        swap(StemLM(model_config("debug", tie_embeddings=True)), [1], [2], embedding=True)
