"""Which layers a conversion replaces: per-layer costs measured alone, the cheapest chosen, the choice recorded."""

import json

import pytest
import torch
import torch.nn.functional as F

from stemlm.insert import convert as insert_convert
from stemlm.insert.calibrate import CalibrationConfig
from stemlm.insert.placement import cheapest_layers, layer_costs
from test_insert import FIT_BASE, calib_ids, convert_tiny_llama_on_text, dense_model, fit


def calib_of(ids, **kw):
    return CalibrationConfig(**{"tokens": ids.numel(), "seq_len": ids.shape[1], "chunk": 4, **FIT_BASE, **kw})


@torch.no_grad()
def kl_per_token(dense, converted, ids) -> float:
    ref, lp = F.log_softmax(dense(ids).float(), -1), F.log_softmax(converted(ids).float(), -1)
    return float((ref.exp() * (ref - lp)).sum() / ids.numel())


@pytest.mark.parametrize("refit_down", [False, True])
def test_a_layers_cost_is_the_kl_of_the_model_with_that_layer_alone_converted(tmp_path, refit_down):
    model, ids = dense_model(), calib_ids()
    calib = calib_of(ids, refit_down=refit_down)
    costs = layer_costs(model, "stem", ids, calib, probe_windows=len(ids), progress=False)
    assert len(costs) == model.cfg.n_layers
    for layer in (1, 3):
        converted, _ = fit(model, ids, tmp_path / f"{layer}", layers=str(layer), refit_down=refit_down)
        assert costs[layer] == pytest.approx(kl_per_token(model, converted, ids), rel=1e-3, abs=1e-6)
    assert all(c > 0 for c in costs)


def test_a_layer_whose_up_projection_is_zero_costs_nothing_and_is_chosen(tmp_path):
    model, ids = dense_model(), calib_ids()
    with torch.no_grad():
        model.layers[2].ffn.w_up.weight.zero_()  # W_u x = 0: the zero row replaces it exactly
    costs = layer_costs(model, "stem", ids, calib_of(ids, refit_down=True), progress=False)
    assert costs[2] == pytest.approx(0.0, abs=1e-6)
    assert min(costs[i] for i in (0, 1, 3)) > 1e-5
    assert cheapest_layers(costs, 1) == [2]


def test_cheapest_layers_keeps_layer_order_and_breaks_ties_by_the_earlier_layer():
    assert cheapest_layers([0.3, 0.1, 0.2, 0.1], 2) == [1, 3]
    assert cheapest_layers([0.3, 0.1, 0.2, 0.1], 3) == [1, 2, 3]
    assert cheapest_layers([0.2, 0.2, 0.2], 2) == [0, 1]
    with pytest.raises(ValueError, match="cannot choose 5 of 3 layers"):
        cheapest_layers([0.1, 0.2, 0.3], 5)


def test_placement_given_as_layers_or_uniform_is_kept_and_costs_are_measured_once(tmp_path, monkeypatch):
    monkeypatch.setenv("STEMLM_CACHE", str(tmp_path / "cache"))
    model, ids = dense_model(n_layers=6), calib_ids()
    tokens = ids.reshape(-1).numpy()
    calib = calib_of(ids)
    kept, costs = insert_convert.placed_target(model, "stem", "2,5", tokens, calib)
    assert kept.stem_layer_ids == (2, 5) and costs is None
    kept, costs = insert_convert.placed_target(model, "stem", "1/3", tokens, calib_of(ids, layer_choice="uniform"))
    assert kept.stem_layer_ids == (2, 5) and costs is None
    kept, costs = insert_convert.placed_target(model, "stem_dagger", "1/3", tokens, calib)
    assert kept.stem_layer_ids == (2, 5) and costs is None  # zero dagger rows are the dense layer everywhere
    chosen, costs = insert_convert.placed_target(model, "stem", "1/3", tokens, calib)
    assert len(chosen.stem_layer_ids) == 2 and chosen.stem_layer_ids == tuple(cheapest_layers(costs, 2))

    def fail(*a, **k):
        raise AssertionError("measured again")
    monkeypatch.setattr(insert_convert, "layer_costs", fail)
    again, same = insert_convert.placed_target(model, "stem", "1/3", tokens, calib)
    assert same == costs and again.stem_layer_ids == chosen.stem_layer_ids
    # what the scoring pass leaves out (distillation, drift correction) shares the measurement
    shared, _ = insert_convert.placed_target(model, "stem", "1/3", tokens,
                                             calib_of(ids, distill_steps=5, distill_down=True, correct_drift=True))
    assert shared.stem_layer_ids == chosen.stem_layer_ids
    with pytest.raises(AssertionError, match="measured again"):  # other settings: other costs
        insert_convert.placed_target(model, "stem", "1/3", tokens, calib_of(ids, shrink=4.0))


def test_convert_calibrate_converts_the_cheapest_layers_and_records_why(tmp_path, monkeypatch):
    out = convert_tiny_llama_on_text(tmp_path, monkeypatch, "1/2")
    conv = json.loads((out / "config.json").read_text())["stemlm_conversion"]
    costs = conv["calibration"]["layer_costs"]
    assert conv["calibration"]["placement"] == "1/2" and conv["calibration"]["layer_choice"] == "cheapest"
    assert conv["stem_layers"] == cheapest_layers(costs, len(costs) // 2)


def test_bad_layer_choice_is_a_one_line_error():
    with pytest.raises(ValueError, match="unknown layer_choice 'best'; choose one of cheapest, uniform"):
        CalibrationConfig(layer_choice="best")
