"""After calibration: alternating least squares and local (layer-wise) distillation of the converted layers."""

import pytest
import torch
import torch.nn.functional as F

from stemlm.insert.calibrate import CalibrationConfig, assemble, calibrate
from stemlm.insert.distill import DistillSettings, alternate_layer, distill_layer, layer_error
from test_insert import FIT_BASE, V, calib_ids, dense_model, ffn_io, fit
from train_helpers import one_thread  # noqa: F401

DISTILL = {"distill_steps": 60, "distill_batch": 32, "distill_lr": 1e-2}


def output_error(stem, model, ids, layer=2):
    x, y = ffn_io(model, ids, layer)
    ffn = stem.layers[layer].ffn
    rows = stem.tables[str(layer)].weight[ids.reshape(-1)]
    return float((ffn.w_down(F.silu(ffn.w_gate(x)) * rows) - y).square().sum() / y.square().sum())


def test_alternating_least_squares_and_distillation_lower_the_layer_s_output_error(tmp_path):
    model, ids = dense_model(), calib_ids()
    base = output_error(fit(model, ids, tmp_path / "g", sequential=False)[0], model, ids)
    refit = output_error(fit(model, ids, tmp_path / "r", sequential=False, refit_down=True)[0], model, ids)
    als = output_error(fit(model, ids, tmp_path / "a", sequential=False, als_rounds=2)[0], model, ids)
    rows_only = output_error(fit(model, ids, tmp_path / "d", sequential=False, **DISTILL)[0], model, ids)
    both = output_error(fit(model, ids, tmp_path / "b", sequential=False, refit_down=True, distill_down=True,
                            **DISTILL)[0], model, ids)
    assert als < refit < base
    assert rows_only < base and both < refit


def test_distillation_trains_only_the_seen_rows_and_leaves_the_dense_model_alone(tmp_path):
    model, ids = dense_model(), calib_ids()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    fitted, _ = fit(model, ids, tmp_path / "f", sequential=False)
    distilled, _ = fit(model, ids, tmp_path / "d", sequential=False, **DISTILL)
    seen = torch.zeros(V, dtype=torch.bool)
    seen[ids.reshape(-1)] = True
    a, b = fitted.tables["2"].weight, distilled.tables["2"].weight
    assert torch.equal(a[~seen], b[~seen]) and not torch.allclose(a[seen], b[seen])
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.requires_grad for p in model.parameters()) and all(p.grad is None for p in model.parameters())


def test_distillation_is_deterministic_and_a_pass_resumes_to_the_same_tables(tmp_path, monkeypatch):
    model, ids = dense_model(), calib_ids()
    kw = {"refit_down": True, "distill_down": True, "distill_gate": True, **DISTILL}
    one, _ = fit(model, ids, tmp_path / "1", layers="1,3", **kw)
    two, _ = fit(model, ids, tmp_path / "2", layers="1,3", **kw)
    for k in ("1", "3"):
        assert torch.equal(one.tables[k].weight, two.tables[k].weight)
        for name in ("w_down", "w_gate"):
            assert torch.equal(getattr(one.layers[int(k)].ffn, name).weight, getattr(two.layers[int(k)].ffn, name).weight)
    import stemlm.insert.calibrate as cal

    real, calls = cal.fit_layer, []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    target = model.cfg.replace(ffn="stem", stem_layers="1,3")
    calib = CalibrationConfig(tokens=ids.numel(), seq_len=ids.shape[1], chunk=4, **{**FIT_BASE, **kw})
    monkeypatch.setattr(cal, "fit_layer", failing)
    with pytest.raises(KeyboardInterrupt):
        calibrate(model, target, ids, calib, tmp_path / "work", progress=False, save_every_s=0)
    monkeypatch.setattr(cal, "fit_layer", real)
    resumed = assemble(model, target, calibrate(model, target, ids, calib, tmp_path / "work", progress=False))
    for k in ("1", "3"):
        assert torch.equal(resumed.tables[k].weight, one.tables[k].weight)
        assert torch.equal(resumed.layers[int(k)].ffn.w_gate.weight, one.layers[int(k)].ffn.w_gate.weight)


def test_distilling_w_g_too_lowers_the_error_further_and_changes_only_the_converted_layers(tmp_path):
    model, ids = dense_model(), calib_ids()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    # lr 1e-3: at the 1e-2 of DISTILL the moving W_g costs this toy (every id seen often) more than it gains
    kw = {"sequential": False, "refit_down": True, "distill_down": True, "distill_steps": 200, "distill_batch": 32,
          "distill_lr": 1e-3}
    both, _ = fit(model, ids, tmp_path / "b", **kw)
    gate, _ = fit(model, ids, tmp_path / "g", distill_gate=True, **kw)
    assert output_error(gate, model, ids) < output_error(both, model, ids)
    for i, layer in enumerate(gate.layers):  # W_g moved in the converted layer only; the dense model untouched
        moved = not torch.equal(layer.ffn.w_gate.weight, model.layers[i].ffn.w_gate.weight)
        assert moved == (i == 2)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.requires_grad for p in model.parameters()) and all(p.grad is None for p in model.parameters())
    x, y = ffn_io(model, ids, 2)  # the error distillation reports is the assembled layer's
    ffn, flat = model.layers[2].ffn, ids.reshape(-1)
    trained = gate.layers[2].ffn
    assert layer_error(ffn, "stem", x, flat, gate.tables["2"].weight,
                       {"w_down": trained.w_down.weight, "w_gate": trained.w_gate.weight}, y) == pytest.approx(output_error(gate, model, ids), rel=1e-5)


def test_distilling_w_g_needs_a_layer_that_keeps_it_and_distillation_steps():
    model, ids = dense_model(), calib_ids()
    x, _ = ffn_io(model, ids, 2)
    with pytest.raises(ValueError, match="train_gate needs a layer that keeps W_g"):
        distill_layer(model.layers[2].ffn, "stem_gate", x, ids.reshape(-1), torch.zeros(V, model.cfg.d_ff), {},
                      DistillSettings(steps=2, train_gate=True))
    with pytest.raises(ValueError, match="distill_gate trains W_g during local distillation: set distill_steps > 0"):
        CalibrationConfig(distill_gate=True)


def test_layer_functions_report_the_error_they_reach():
    model, ids = dense_model(), calib_ids()
    x, y = ffn_io(model, ids, 2)
    ffn, flat = model.layers[2].ffn, ids.reshape(-1)
    rows = torch.zeros(V, model.cfg.d_ff)
    r, wd, info = alternate_layer(ffn, "stem", x, flat, rows, rounds=1)
    assert info["error_after"] == pytest.approx(layer_error(ffn, "stem", x, flat, r, {"w_down": wd}, y))
    assert info["error_after"] < info["error_before"] == pytest.approx(1.0)
    r2, wd2, info2 = distill_layer(ffn, "stem", x, flat, rows, {}, DistillSettings(steps=30, lr=1e-2, batch=32))
    assert wd2 == {} and info2["error_after"] < info2["error_before"] and not info2["kept_start"]


def layer2_distillations(*settings: DistillSettings) -> list[tuple]:
    """``distill_layer`` of the toy model's layer 2, from zero rows, with each of ``settings``."""
    model, ids = dense_model(), calib_ids()
    x, _ = ffn_io(model, ids, 2)
    ffn, flat = model.layers[2].ffn, ids.reshape(-1)
    rows = torch.zeros(V, model.cfg.d_ff)
    return [distill_layer(ffn, "stem", x, flat, rows, {}, s) for s in settings]


def assert_same_distillation(got: tuple, want: tuple, atol: float = 1e-6) -> None:
    """Two ``distill_layer`` results agree: rows, trained projections and the error reached."""
    (r1, w1, i1), (r2, w2, i2) = got, want
    torch.testing.assert_close(r1, r2, rtol=1e-4, atol=atol)
    assert w1.keys() == w2.keys()
    for name in w1:
        torch.testing.assert_close(w1[name], w2[name], rtol=1e-4, atol=atol)
    assert i1["error_after"] == pytest.approx(i2["error_after"], rel=1e-4)


def test_fused_adam_distils_as_the_default_adam_does_to_rounding():
    fused, default = layer2_distillations(*(DistillSettings(steps=30, lr=1e-2, batch=32, train_down=True,
                                                            train_gate=True, fused_adam=f, rows="dense",
                                                            precision="fp32") for f in (True, False)))
    assert_same_distillation(fused, default)


def test_lazy_rows_distil_as_dense_adam_when_every_step_touches_every_row():
    # a minibatch of every token: each step touches every row, so per-row bias corrections are the global ones and
    # the lazy update is torch's Adam to rounding
    n_tokens = calib_ids().numel()
    dense, lazy = layer2_distillations(*(DistillSettings(steps=20, lr=1e-2, batch=n_tokens, train_down=True, rows=k,
                                                         precision="fp32") for k in ("dense", "lazy")))
    assert_same_distillation(lazy, dense)


def test_catchup_rows_distil_as_dense_adam_with_small_minibatches():
    # minibatches of 16 of 144 tokens: most rows skip most steps; their skipped steps, applied in closed form when
    # they are next read, give torch's Adam over every row (to rounding with eps -> 0; within eps's share otherwise)
    import functools

    from stemlm.insert import distill

    def run(kind, eps=None):
        settings = DistillSettings(steps=60, lr=1e-2, batch=16, train_down=True, rows=kind, fused_adam=False,
                                   precision="fp32")
        if eps is None:
            return layer2_distillations(settings)[0]
        adam, row_eps = torch.optim.Adam, distill._RowAdam.eps
        torch.optim.Adam, distill._RowAdam.eps = functools.partial(adam, eps=eps), eps
        try:
            return layer2_distillations(settings)[0]
        finally:
            torch.optim.Adam, distill._RowAdam.eps = adam, row_eps

    assert_same_distillation(run("catchup", 1e-30), run("dense", 1e-30), atol=1e-5)
    (r1, _, i1), (r2, _, i2), (r3, _, i3) = run("dense"), run("catchup"), run("lazy")
    assert (r2 - r1).abs().max() < 0.01 * r1.abs().max() < (r3 - r1).abs().max()  # lazy is another update
    assert i2["error_after"] == pytest.approx(i1["error_after"], rel=1e-4)


def test_catchup_rows_stay_finite_where_a_gradient_element_is_exactly_zero():
    # an element whose gradient is 0 keeps m = v = 0; a row read again right after its update skipped no step: the
    # catch-up's 0 / (sqrt(0) + 0) was NaN (seen on SmolLM2's layer 12 with bf16 GEMMs)
    from stemlm.insert.distill import _RowAdam

    weight = torch.randn(6, 4)
    rows_adam = _RowAdam(weight, True, [1e-2] * 10)
    grad = torch.randn(6, 4)
    grad[:, 0] = 0
    for t in range(1, 8):
        rows = torch.tensor([0, 1, 2]) if t % 2 else torch.tensor([1, 3])
        w, m, v = rows_adam.gather(rows, t)
        rows_adam.update(rows, w, m, v, grad[rows], 1e-2)
    rows_adam.finish()
    assert torch.isfinite(weight).all()


def test_lazy_rows_move_only_the_rows_of_the_minibatch_and_lower_the_error():
    model, ids = dense_model(), calib_ids()
    x, _ = ffn_io(model, ids, 2)
    ffn, flat = model.layers[2].ffn, ids.reshape(-1)
    rows = torch.zeros(V, model.cfg.d_ff)
    settings = DistillSettings(steps=1, lr=1e-2, batch=8, rows="lazy")
    one, _, _ = distill_layer(ffn, "stem", x, flat, rows, {}, settings)
    gen = torch.Generator().manual_seed(settings.seed)  # the first minibatch, as distill_layer draws it
    first = flat[torch.randperm(len(flat), generator=gen)[:settings.batch]].unique()
    moved = (one != rows).any(1).nonzero().squeeze(1)
    assert set(moved.tolist()) == set(first.tolist())
    _, _, info = distill_layer(ffn, "stem", x, flat, rows, {}, DistillSettings(steps=40, lr=1e-2, batch=32,
                                                                               rows="lazy"))
    assert info["error_after"] < info["error_before"] and not info["kept_start"]


def test_bf16_gemms_distil_to_the_fp32_result_within_bf16_rounding():
    from stemlm.insert.distill import bf16_is_fast, resolved_precision

    model, ids = dense_model(), calib_ids()
    x, _ = ffn_io(model, ids, 2)
    ffn, flat = model.layers[2].ffn, ids.reshape(-1)
    rows = torch.zeros(V, model.cfg.d_ff)
    (_, _, fp32), (r, w, bf16) = [
        distill_layer(ffn, "stem", x, flat, rows, {}, DistillSettings(steps=30, lr=1e-2, batch=32, train_down=True,
                                                                      train_gate=True, precision=p))
        for p in ("fp32", "bf16")]
    assert bf16["error_after"] < bf16["error_before"] and not bf16["kept_start"]
    assert bf16["error_after"] == pytest.approx(fp32["error_after"], rel=0.05)
    assert r.dtype == w["w_down"].dtype == w["w_gate"].dtype == torch.float32  # fp32 results, fp32 state
    assert resolved_precision("fp32", torch.device("cpu")) == "fp32"
    assert resolved_precision("auto", torch.device("cpu")) == ("bf16" if bf16_is_fast(torch.device("cpu")) else "fp32")
    assert resolved_precision("auto", torch.device("cuda")) == "bf16"


def test_distillation_s_row_update_and_precision_key_the_work_dir_only_when_they_change_it():
    from stemlm.config import ModelConfig

    target = dense_model().cfg
    base = {"distill_steps": 5, "distill_lr": 1e-2}
    key = CalibrationConfig(**base, distill_rows="dense", distill_precision="fp32").key("m", "i", target)
    assert CalibrationConfig(**base, distill_rows="lazy", distill_precision="fp32").key("m", "i", target) != key
    assert CalibrationConfig(**base, distill_rows="dense", distill_precision="bf16").key("m", "i", target) != key
    assert CalibrationConfig(**base).key("m", "i", target) != key  # the defaults: catch-up rows, auto precision
    # a work dir keyed before these settings existed (dense rows, fp32: the key of this conversion then) stays valid
    recipe = {"distill_steps": 2000, "distill_lr": 2e-3, "distill_batch": 1024, "distill_down": True,
              "distill_gate": True, "distill_rows": "dense", "distill_precision": "fp32"}
    assert CalibrationConfig(**recipe).key("m", "i", ModelConfig()) == "9a2bd3716e8738ad"
    assert CalibrationConfig(distill_rows="lazy", distill_precision="bf16").key("m", "i", target) == \
        CalibrationConfig().key("m", "i", target)  # no distillation: they change nothing
    with pytest.raises(ValueError, match="distillation rows must be one of dense, catchup, lazy, got 'sparse'"):
        CalibrationConfig(distill_rows="sparse")
    with pytest.raises(ValueError, match="distillation precision must be one of fp32, bf16, auto, got 'fp16'"):
        CalibrationConfig(distill_precision="fp16")


def test_distillation_that_ends_worse_than_its_start_keeps_the_start():
    model, ids = dense_model(), calib_ids()
    x, y = ffn_io(model, ids, 2)
    ffn, flat = model.layers[2].ffn, ids.reshape(-1)
    rows, wd, _ = alternate_layer(ffn, "stem", x, flat, torch.zeros(V, model.cfg.d_ff), rounds=2)  # a good start
    r, wd2, info = distill_layer(ffn, "stem", x, flat, rows, {"w_down": wd},
                                 DistillSettings(steps=20, lr=30.0, batch=8, train_down=True, train_gate=True,
                                                 precision="fp32"))
    assert info["kept_start"] and info["error_after"] > info["error_before"]
    assert torch.equal(r, rows) and wd2 == {"w_down": wd}  # the start, unchanged (no trained W_g either)
    wd2 = wd2["w_down"]
    assert layer_error(ffn, "stem", x, flat, r, {"w_down": wd2}, y) == pytest.approx(info["error_before"])


def test_bad_distillation_settings_are_one_line_errors():
    with pytest.raises(ValueError, match="distill_steps must be >= 0"):
        CalibrationConfig(distill_steps=-1)
    with pytest.raises(ValueError, match="distill_batch >= 1"):
        CalibrationConfig(distill_batch=0)
    with pytest.raises(ValueError, match="als_rounds must be >= 0"):
        CalibrationConfig(als_rounds=-2)


def test_convert_cli_distills_after_calibrating(tmp_path, monkeypatch, capsys):
    import json

    from stemlm.cli import main
    from test_hf import llama_dir

    monkeypatch.setenv("STEMLM_CACHE", str(tmp_path / "cache"))
    _, src = llama_dir(tmp_path)
    text = tmp_path / "calib.txt"
    text.write_text("\n\n".join(["the cat sat on the mat and the dog ran in the park"] * 40))
    out = tmp_path / "out"
    assert main(["convert", "--from-hf", str(src), "--out", str(out), "--ffn", "stem", "--stem-layers", "2",
                 "--init", "calibrate", "--calib-data", str(text), "--calib-tokens", "256", "--calib-seq-len", "16",
                 "--distill-steps", "5", "--distill-batch", "16", "--distill-down", "--distill-gate",
                 "--distill-rows", "lazy", "--distill-precision", "bf16"]) == 0
    calib = json.loads((out / "config.json").read_text())["stemlm_conversion"]["calibration"]
    assert calib["distill_steps"] == 5 and calib["distill_down"] is True and calib["distill_gate"] is True
    assert calib["distill_rows"] == "lazy" and calib["distill_precision"] == "bf16"
    assert main(["convert", "--from-hf", str(src), "--out", str(tmp_path / "o2"), "--ffn", "stem",
                 "--distill-steps", "3"]) != 0
    assert "--distill-steps applies to --init calibrate only" in capsys.readouterr().err


def test_shrink_pulls_rarely_seen_rows_towards_the_pooled_row():
    from stemlm.insert.fit import LayerStats

    stats = LayerStats.zeros(4, 2)
    ids = torch.tensor([0] * 50 + [1])
    target = torch.cat([torch.ones(50, 2), torch.full((1, 2), 10.0)])
    stats.add(ids, target, None)
    pooled = target.mean(0)
    plain, shrunk = stats.rows(), stats.rows(shrink=1.0)
    torch.testing.assert_close(plain[1], torch.full((2,), 10.0))
    torch.testing.assert_close(shrunk[1], (10.0 + pooled) / 2)  # one context and one pseudo-context of the pool
    assert (shrunk[0] - plain[0]).abs().max() < (shrunk[1] - plain[1]).abs().max() / 10
    torch.testing.assert_close(shrunk[3], pooled)


def _last_hidden(model, ids, layer):
    seen = {}
    hook = model.layers[layer].register_forward_hook(lambda m, a, out: seen.setdefault("h", out))
    with torch.no_grad():
        model(ids)
    hook.remove()
    return seen["h"]


@pytest.mark.parametrize("extra", [{}, DISTILL])
def test_correct_drift_brings_the_converted_stream_closer_to_the_dense_one(tmp_path, extra):
    model, ids = dense_model(), calib_ids()
    kw = {"refit_down": True, "layers": "1,3", **extra}
    plain, _ = fit(model, ids, tmp_path / "plain", **kw)
    drift, _ = fit(model, ids, tmp_path / "drift", correct_drift=True, **kw)
    # nothing drifted before the first converted layer: the same fit there, up to float rounding (which Adam's
    # normalised steps amplify when distilling)
    tol = {"rtol": 1e-2, "atol": 1e-3} if extra else {"rtol": 1e-4, "atol": 1e-5}
    torch.testing.assert_close(drift.layers[1].ffn.w_down.weight, plain.layers[1].ffn.w_down.weight, **tol)
    torch.testing.assert_close(drift.tables["1"].weight, plain.tables["1"].weight, **tol)
    assert not torch.allclose(drift.layers[3].ffn.w_down.weight, plain.layers[3].ffn.w_down.weight, atol=1e-4)
    dense_h = _last_hidden(model, ids, 3)
    errors = [float((_last_hidden(m, ids, 3) - dense_h).square().sum() / dense_h.square().sum()) for m in (plain, drift)]
    assert errors[1] < errors[0]  # after the last converted layer, on the calibration text


def test_correct_drift_needs_a_sequential_pass_without_als():
    with pytest.raises(ValueError, match="correct_drift needs sequential"):
        CalibrationConfig(correct_drift=True, sequential=False)
    with pytest.raises(ValueError, match="not to als_rounds"):
        CalibrationConfig(correct_drift=True, als_rounds=1)
    assert CalibrationConfig().key("m", "i", dense_model().cfg) != CalibrationConfig(correct_drift=True).key(
        "m", "i", dense_model().cfg)
