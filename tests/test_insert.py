"""Insertion of STEM into a dense model: calibrated tables, gradual insertion (anneal), conversion."""

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from stemlm import StemLM, model_config
from stemlm.config import ConfigError
from stemlm.data import TokenDataset
from stemlm.insert.anneal import scales_at, set_scales, to_stem
from stemlm.insert.calibrate import CalibrationConfig, assemble, calibrate, calibration_windows
from stemlm.ffn import StemGateFFN
from stemlm.insert.fit import LayerStats, refine_through_down
from stemlm.store import open_model
from stemlm.interop.convert import convert_from_hf, llama_to_stem
from test_hf import llama_dir, tiny_llama
from train_helpers import debug_config, losses, make_token_data, one_thread  # noqa: F401

V = 96


def dense_model(seed: int = 0, n_layers: int = 4) -> StemLM:
    torch.manual_seed(seed)
    cfg = model_config("debug", ffn="dense", vocab_size=V, n_layers=n_layers)
    model = StemLM(cfg).eval()
    with torch.no_grad():  # a larger spread than the init, so activations depend on context
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(4.0)
    return model


def calib_ids(n_seq=6, T=24, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V - 10, (n_seq, T), generator=g)  # the last 10 ids are never seen


FIT_BASE = {"refit_down": False, "shrink": 0.0}  # the plain fit, whatever convert's defaults add to it


def fit(model, ids, tmp_path, kind="stem", layers="2", **kw):
    target = model.cfg.replace(ffn=kind, stem_layers=layers)
    calib = CalibrationConfig(**{"tokens": ids.numel(), "seq_len": ids.shape[1], "chunk": 4, **FIT_BASE, **kw})
    fitted = calibrate(model, target, ids, calib, tmp_path / "work", progress=False)
    return assemble(model, target, fitted), fitted


@torch.no_grad()
def ffn_io(model, ids, layer):
    """(normed FFN input (N, d), dense FFN output (N, d)) at ``layer`` of the dense model."""
    seen = {}
    block = model.layers[layer]
    hook = block.ffn_norm.register_forward_hook(lambda m, a, out: seen.setdefault("x", out))
    model(ids)
    hook.remove()
    x = seen["x"].reshape(-1, model.cfg.d_model)
    return x, block.ffn(x)


def test_gated_rows_are_the_gate_weighted_mean_of_the_up_projection(tmp_path):
    model, ids = dense_model(), calib_ids()
    stem, _ = fit(model, ids, tmp_path, sequential=False)
    x, _ = ffn_io(model, ids, 2)
    ffn = model.layers[2].ffn
    a, g2 = ffn.w_up(x), F.silu(ffn.w_gate(x)).square()
    flat = ids.reshape(-1)
    for t in flat.unique()[:8].tolist():
        sel = flat == t
        want = (g2[sel] * a[sel]).sum(0) / g2[sel].sum(0)
        torch.testing.assert_close(stem.tables["2"].weight[t], want, rtol=1e-5, atol=1e-6)
    pooled = (g2 * a).sum(0) / g2.sum(0)  # ids never seen get the fit over all contexts
    torch.testing.assert_close(stem.tables["2"].weight[V - 1], pooled, rtol=1e-5, atol=1e-6)


def test_gated_fit_minimises_the_gated_product_error(tmp_path):
    """Per coordinate, gated rows are the least-squares fit of SiLU(W_g x) ⊙ W_u x: mean and zero rows do worse."""
    model, ids = dense_model(), calib_ids()
    x, _ = ffn_io(model, ids, 2)
    ffn = model.layers[2].ffn
    target = F.silu(ffn.w_gate(x)) * ffn.w_up(x)
    errors = {}
    for method in ("gated", "mean", "zero"):
        stem, _ = fit(model, ids, tmp_path / method, method=method, sequential=False)
        rows = stem.tables["2"].weight[ids.reshape(-1)]
        errors[method] = (F.silu(ffn.w_gate(x)) * rows - target).square().sum().item()
    assert errors["gated"] < errors["mean"] < errors["zero"]


def test_down_refinement_and_down_refit_lower_the_output_error(tmp_path):
    model, ids = dense_model(), calib_ids()
    x, y = ffn_io(model, ids, 2)

    def out_error(stem):
        ffn = stem.layers[2].ffn
        rows = stem.tables["2"].weight[ids.reshape(-1)]
        return (ffn.w_down(F.silu(ffn.w_gate(x)) * rows) - y).square().sum().item()

    gated = out_error(fit(model, ids, tmp_path / "g", sequential=False)[0])
    down = out_error(fit(model, ids, tmp_path / "d", sequential=False, method="down", down_iters=6)[0])
    refit = out_error(fit(model, ids, tmp_path / "r", sequential=False, refit_down=True)[0])
    assert down < gated and refit < gated


def test_refine_through_down_solves_each_tokens_least_squares():
    torch.manual_seed(0)
    n, f, d = 40, 6, 5
    ids = torch.tensor([0, 1, 2, 3] * 10)
    gate, y, wd = torch.rand(n, f) + 0.5, torch.randn(n, d), torch.randn(d, f)
    out = refine_through_down(torch.zeros(5, f), ids, gate, y, wd, iters=f)
    for t in range(4):
        sel = ids == t
        a = torch.cat([wd * gate[i] for i in sel.nonzero().flatten()])  # (k·d, f): rows W_d diag(g)
        want = torch.linalg.lstsq(a.double(), y[sel].reshape(-1).double()).solution.float()
        torch.testing.assert_close(out[t], want, rtol=1e-3, atol=1e-4)
    assert torch.equal(out[4], torch.zeros(f))  # an id without contexts keeps its start row


def test_sequential_fit_sees_the_converted_layers_and_is_deterministic(tmp_path):
    model, ids = dense_model(), calib_ids()
    par, _ = fit(model, ids, tmp_path / "p", layers="1,3", sequential=False)
    seq, _ = fit(model, ids, tmp_path / "s", layers="1,3")
    again, _ = fit(model, ids, tmp_path / "s2", layers="1,3")
    assert torch.equal(par.tables["1"].weight, seq.tables["1"].weight)  # nothing converted before layer 1
    assert not torch.allclose(par.tables["3"].weight, seq.tables["3"].weight)
    assert torch.equal(seq.tables["3"].weight, again.tables["3"].weight)


def test_interrupted_calibration_resumes_to_the_same_tables(tmp_path, monkeypatch):
    model, ids = dense_model(), calib_ids()
    whole, _ = fit(model, ids, tmp_path / "whole", layers="1,2,3")
    import stemlm.insert.calibrate as cal

    real, calls = cal.fit_layer, []

    def failing(*args, **kw):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*args, **kw)

    target = model.cfg.replace(ffn="stem", stem_layers="1,2,3")
    calib = CalibrationConfig(tokens=ids.numel(), seq_len=ids.shape[1], chunk=4, **FIT_BASE)
    monkeypatch.setattr(cal, "fit_layer", failing)
    with pytest.raises(KeyboardInterrupt):
        calibrate(model, target, ids, calib, tmp_path / "work", progress=False, save_every_s=0)
    assert json.loads((tmp_path / "work" / "progress.json").read_text())["next_layer"] == 3
    monkeypatch.setattr(cal, "fit_layer", real)
    logs = []
    fitted = calibrate(model, target, ids, calib, tmp_path / "work", progress=False, log=logs.append)
    assert any("resumed at layer 3" in line for line in logs)
    resumed = assemble(model, target, fitted)
    for k in ("1", "2", "3"):
        assert torch.equal(resumed.tables[k].weight, whole.tables[k].weight)
    monkeypatch.setattr(cal, "fit_layer", failing)  # a finished pass is reused whole: no layer is fitted again
    calls.clear()
    assert calibrate(model, target, ids, calib, tmp_path / "work", progress=False) == fitted and not calls


def test_stem_dagger_with_zero_tables_is_exactly_the_dense_model(tmp_path):
    model, ids = dense_model(), calib_ids()
    dagger, _ = fit(model, ids, tmp_path, kind="stem_dagger", layers="1,3")
    assert torch.equal(dagger.tables["1"].weight, torch.zeros(V, model.cfg.d_ff))
    assert torch.equal(dagger(ids), model(ids))


def test_dagger_rows_fitted_for_blend_equal_the_stem_rows_and_end_as_that_stem_model(tmp_path):
    model, ids = dense_model(), calib_ids()
    stem, _ = fit(model, ids, tmp_path / "s", layers="1,3")
    blend, _ = fit(model, ids, tmp_path / "b", kind="stem_dagger", layers="1,3", dagger_rows="fit", refit_down=True)
    for k in ("1", "3"):
        assert torch.equal(blend.tables[k].weight, stem.tables[k].weight)
    set_scales(blend, 1.0, 0.0)  # blend at step 0: the dense model (refit_down is not applied to a dagger start)
    assert torch.equal(blend(ids), model(ids))
    set_scales(blend, 0.0, 1.0)  # ... at the end: the calibrated STEM model
    torch.testing.assert_close(blend(ids), stem(ids), rtol=0, atol=1e-5)


def test_calibrated_stem_gate_rows_replace_the_gate_preactivation(tmp_path):
    model, ids = dense_model(), calib_ids()
    gate_model, _ = fit(model, ids, tmp_path, kind="stem_gate", sequential=False)
    x, _ = ffn_io(model, ids, 2)
    target, weight = StemGateFFN.calibration_target(model.layers[2].ffn, x)
    stats = LayerStats.zeros(V, model.cfg.d_ff)
    stats.add(ids.reshape(-1), target, weight)
    torch.testing.assert_close(gate_model.tables["2"].weight, stats.rows(), rtol=1e-5, atol=1e-6)
    assert "w_gate" not in dict(gate_model.layers[2].ffn.named_children())


def test_calibration_windows_spread_over_the_stream():
    tokens = np.arange(1000)
    w = calibration_windows(tokens, 300, 100)
    assert w.shape == (3, 100) and w[0, 0] == 0 and w[-1, -1] == 999
    with pytest.raises(ValueError, match="fewer than one window"):
        calibration_windows(np.arange(10), 100, 50)


def test_a_layer_s_fit_does_not_depend_on_the_table_layers_after_it(tmp_path):
    """The pass stops after the last table layer; what it fitted before is what a longer pass fits."""
    model, ids = dense_model(), calib_ids()
    _, short = fit(model, ids, tmp_path / "a", layers="1")
    _, long = fit(model, ids, tmp_path / "b", layers="1,3")
    assert torch.equal(load_file(short[1][0])["rows"], load_file(long[1][0])["rows"])
    assert set(short) == {1} and set(long) == {1, 3}


def test_calibration_device_is_not_part_of_the_key():
    """The same fit wherever it runs: a pass resumed on another device reuses the work dir."""
    target = model_config("debug", ffn="stem", vocab_size=V)
    assert CalibrationConfig(device="cpu").key("m", "i", target) == CalibrationConfig(device="auto").key("m", "i", target)
    assert CalibrationConfig(device="cpu").torch_device().type == "cpu"


def test_a_float_setting_given_as_an_int_keys_the_same_work_dir():
    target = model_config("debug", ffn="stem", vocab_size=V)
    assert CalibrationConfig(shrink=4096, distill_steps=5, distill_lr=1).key("m", "i", target) == \
        CalibrationConfig(shrink=4096.0, distill_steps=5, distill_lr=1.0).key("m", "i", target)
    assert CalibrationConfig(distill_steps=5, distill_lr="2e-3").distill_lr == 0.002  # YAML 1.1 reads 2e-3 as text
    with pytest.raises(ValueError, match="calibration shrink: 'lots' is not a finite number"):
        CalibrationConfig(shrink="lots")


def test_bad_calibration_settings_are_one_line_errors():
    with pytest.raises(ValueError, match="unknown calibration method 'bogus'"):
        CalibrationConfig(method="bogus")
    with pytest.raises(ValueError, match="calibration tokens"):
        CalibrationConfig(tokens=10, seq_len=64)
    with pytest.raises(ValueError, match="calibration device: unknown device 'gpu0'"):
        CalibrationConfig(device="gpu0")
    with pytest.raises(ValueError, match="all-dense model"):
        calibrate(StemLM(model_config("debug", ffn="stem", vocab_size=V)), model_config("debug", ffn="stem", vocab_size=V),
                  calib_ids(), CalibrationConfig(tokens=144, seq_len=24), "unused", progress=False)


# -- conversion -------------------------------------------------------------------------------
def convert_tiny_llama_on_text(tmp_path, monkeypatch, stem_layers: str):
    """A tiny Llama directory converted to STEM at ``stem_layers`` with rows calibrated on a raw text file."""
    monkeypatch.setenv("STEMLM_CACHE", str(tmp_path / "cache"))
    _, src = llama_dir(tmp_path)
    text = tmp_path / "calib.txt"
    text.write_text("\n\n".join(["the cat sat on the mat and the dog ran in the park"] * 40))
    return convert_from_hf(src, tmp_path / "out", ffn="stem", stem_layers=stem_layers, init="calibrate",
                           calib_data=text, calibration=CalibrationConfig(tokens=256, seq_len=16), progress=False)


def test_convert_calibrate_from_a_llama_directory_with_raw_text(tmp_path, monkeypatch):
    out = convert_tiny_llama_on_text(tmp_path, monkeypatch, "2")
    model = open_model(out)
    conv = json.loads((out / "config.json").read_text())["stemlm_conversion"]
    assert conv["init"] == "calibrate" and conv["calibration"]["tokens"] == 256
    assert not (tmp_path / "out.calibrating").exists()  # the work dir is removed once the checkpoint is written
    dense = llama_to_stem(tiny_llama(), ffn="dense")  # same seed state not needed: only shapes and finiteness here
    assert model.tables["2"].weight.shape == (dense.cfg.vocab_size, dense.cfg.d_ff)
    assert torch.isfinite(model.tables["2"].weight).all()


def test_convert_zero_dagger_equals_the_llama(tmp_path):
    llama, src = llama_dir(tmp_path)
    out = convert_from_hf(src, tmp_path / "out", ffn="stem_dagger", stem_layers="1,2", init="zero", progress=False)
    x = torch.randint(3, 128, (2, 10))
    torch.testing.assert_close(open_model(out)(x), llama(x).logits, rtol=0, atol=1e-5)


# -- gradual insertion --------------------------------------------------------------------------
def test_anneal_schedule_starts_dense_and_ends_as_stem():
    assert scales_at("dagger", 0, 100, 0.5) == (1.0, 1.0)
    assert scales_at("blend", 0, 100, 0.5) == (1.0, 0.0)
    assert scales_at("blend", 50, 100, 0.5) == (0.0, 1.0) == scales_at("dagger", 80, 100, 0.5)
    s, r = scales_at("blend", 25, 100, 0.5)
    assert 0 < s < 1 and r == pytest.approx(1 - s)


def test_to_stem_equals_the_annealed_dagger_model(tmp_path):
    model, ids = dense_model(), calib_ids()
    dagger, _ = fit(model, ids, tmp_path, kind="stem_dagger", layers="1,3")
    with torch.no_grad():
        for t in dagger.tables.values():
            t.weight.normal_()
    with pytest.raises(ValueError, match="not annealed out"):
        to_stem(dagger)
    set_scales(dagger, 0.0, 1.0)
    stem = to_stem(dagger)
    assert stem.cfg.layer_kinds == ("dense", "stem", "dense", "stem")
    assert torch.equal(stem(ids), dagger(ids))


def test_trainer_anneals_a_dagger_model_from_exactly_dense(tmp_path):
    data = make_token_data(tmp_path / "data")
    torch.manual_seed(0)
    dense = StemLM(model_config("debug", ffn="dense"))
    from stemlm.checkpoint.directory import save_model
    from stemlm.train import Trainer

    dense_ckpt = save_model(dense, tmp_path / "dense")
    calib = CalibrationConfig(tokens=512, seq_len=32)
    ids = calibration_windows(TokenDataset.open(data, "train").tokens, calib.tokens, calib.seq_len)
    target = dense.cfg.replace(ffn="stem_dagger", stem_layers="1,3")
    dagger = assemble(dense, target, calibrate(dense, target, ids, calib, tmp_path / "w", progress=False))
    start = save_model(dagger, tmp_path / "dagger")
    with Trainer(debug_config(data, tmp_path / "d", f"run.init_from={dense_ckpt}", "run.stage=midtrain")) as t:
        dense_loss = t.evaluate()["loss"]
    cfg = debug_config(data, tmp_path / "run", f"run.init_from={start}", "run.stage=midtrain", "run.anneal=dagger",
                       "run.anneal_ratio=0.5", "run.steps=8", "run.eval_every=4")
    with Trainer(cfg) as trainer:
        assert trainer.evaluate()["loss"] == pytest.approx(dense_loss, abs=1e-6)
        trainer.fit()
        assert all(b.ffn.up_scale == 0.0 for b in trainer.model.layers if b.kind == "stem_dagger")
        stem = to_stem(trainer.model)
        res_export = trainer.run_dir / "stem"
    scales = losses(tmp_path / "run", "up_scale")
    assert scales[0] == 1.0 and scales[4] == scales[-1] == 0.0 and 0 < scales[3] < scales[1] < 1
    assert stem.cfg.ffn == "stem"
    exported = open_model(res_export)  # the finished run wrote the pure STEM model it became
    assert exported.cfg.ffn == "stem" and torch.equal(exported.tables["1"].weight, stem.tables["1"].weight)


def test_anneal_needs_a_dagger_model_and_no_compile(tmp_path):
    data = make_token_data(tmp_path / "data")
    from stemlm.train import Trainer

    with pytest.raises(ConfigError, match="stem_dagger"):
        Trainer(debug_config(data, tmp_path / "run", "run.anneal=blend"))
    with pytest.raises(ConfigError, match="run.compile"):
        debug_config(data, tmp_path / "run", "run.anneal=blend", "run.compile=true")


def test_stem_at_places_stem_in_the_chosen_layers_of_a_dagger_fit_model(tmp_path):
    from stemlm.edit.attribution import stem_at

    model, ids = dense_model(), calib_ids()
    every, _ = fit(model, ids, tmp_path / "all", kind="stem_dagger", layers="1,2,3", dagger_rows="fit", sequential=False)
    only2, _ = fit(model, ids, tmp_path / "two", layers="2", sequential=False)
    with stem_at(every, [2]):
        torch.testing.assert_close(every(ids), only2(ids), rtol=0, atol=1e-5)
    with stem_at(every, []):
        torch.testing.assert_close(every(ids), model(ids), rtol=0, atol=1e-5)
    assert [b.ffn.up_scale for b in every.layers[1:]] == [1.0, 1.0, 1.0]  # restored: the file's own scales
    with pytest.raises(ValueError, match="have no table"):
        with stem_at(every, [0]):
            pass


def test_unseen_rows_regressed_from_the_embedding_follow_the_seen_rows_linear_fit():
    from stemlm.insert.fit import regress_rows

    torch.manual_seed(0)
    emb = torch.randn(50, 4, dtype=torch.float64)
    true = torch.randn(5, 3, dtype=torch.float64)
    rows = torch.cat([emb, torch.ones(50, 1, dtype=torch.float64)], 1) @ true  # exactly linear in [e, 1]
    seen = torch.arange(50) < 40
    pred = regress_rows(emb, rows, seen, torch.ones(50, dtype=torch.float64), ridge=1e-9)
    torch.testing.assert_close(pred[~seen], rows[~seen], rtol=1e-5, atol=1e-5)


def test_calibration_with_regressed_unseen_rows_keeps_the_seen_ones(tmp_path):
    model, ids = dense_model(), calib_ids()
    pooled, _ = fit(model, ids, tmp_path / "p", sequential=False)
    regress, _ = fit(model, ids, tmp_path / "r", sequential=False, unseen="regress")
    seen = ids.reshape(-1).unique()
    assert torch.equal(pooled.tables["2"].weight[seen], regress.tables["2"].weight[seen])
    assert not torch.allclose(pooled.tables["2"].weight[V - 1], regress.tables["2"].weight[V - 1])


def test_text_in_a_models_vocabulary_is_prepared_once_whatever_path_the_tokenizer_has(tmp_path, monkeypatch):
    from stemlm.data import corpus_in_vocabulary
    from test_hf import tiny_tokenizer

    monkeypatch.setenv("STEMLM_CACHE", str(tmp_path / "cache"))
    text = tmp_path / "t.txt"
    text.write_text("\n\n".join(["the cat sat on the mat"] * 30))
    dirs = []
    for place in ("a", "b"):
        tiny_tokenizer().save_pretrained(tmp_path / place)
        dirs.append(corpus_in_vocabulary(tmp_path / place / "tokenizer.json", [text], progress=False))
    assert dirs[0] == dirs[1] and (dirs[0] / "train.bin").exists()


def test_mixed_calibration_text_is_a_third_each_of_corpus_news_and_stories():
    from stemlm.insert.convert import MIXED_SOURCES, mixed_tokens

    corpus = np.arange(5000, dtype=np.int64)
    stream, record = mixed_tokens(corpus, lambda text: [len(word) for word in text.split()], 3 * 512, window=64)
    assert stream.shape == (3 * 512,)
    assert np.array_equal(stream[:64], np.arange(64)) and stream[511] == 4999  # windows spread to the corpus's end
    assert set(record) == set(MIXED_SOURCES) and all(r["tokens"] == 512 and len(r["sha256"]) == 64
                                                     for r in record.values())
    again, _ = mixed_tokens(corpus, lambda text: [len(word) for word in text.split()], 3 * 512, window=64)
    assert np.array_equal(stream, again)  # the same text every time


def test_wide_calibration_text_takes_equal_shares_of_the_corpus_and_each_wide_source(monkeypatch):
    from stemlm.data import wide
    from stemlm.insert.convert import wide_tokens

    def source(name, n_docs):  # documents "<name> 0", "<name> 1", ...: each encodes to [source index, doc index]
        return wide.Source(name, f"pkg-{name}", "-", "-", (), lambda: [f"{name} {i}" for i in range(n_docs)])

    monkeypatch.setattr(wide, "SOURCES", (source("a", 40), source("b", 40), source("python-docs", 40)))
    names = {"a": 100, "b": 200, "python-docs": 300}

    def encode(text):
        name, i = text.split()
        return [names[name], int(i)]

    corpus = np.arange(5000, dtype=np.int64)
    stream, record = wide_tokens(corpus, encode, 3 * 64, window=64, exclude=("python-docs",))
    assert stream.shape == (3 * 64,)
    assert np.array_equal(stream[:64], np.arange(64))  # one window of the corpus
    a, b = stream[64:128].reshape(-1, 2), stream[128:].reshape(-1, 2)
    assert set(a[:, 0]) == {100} and set(b[:, 0]) == {200}  # a share each, the excluded source none
    assert len(set(a[:, 1])) == 32 and a[:, 1].max() > 30 and a[:, 1].min() < 5  # 32 documents from all over "a"
    assert record["excluded"] == ["python-docs"] and record["a"]["chunks"] == 32 and record["a"]["of_chunks"] == 40
    again, _ = wide_tokens(corpus, encode, 3 * 64, window=64, exclude=("python-docs",))
    assert np.array_equal(stream, again)  # the same text every time
    with pytest.raises(ValueError, match="unknown sources to exclude"):
        wide_tokens(corpus, encode, 64, exclude=("pyhton-docs",))


def test_calib_data_names_the_wide_corpus_less_some_sources():
    from stemlm.insert.convert import named_source

    assert named_source("wide") == ("wide", ()) and named_source("mixed") == ("mixed", ())
    assert named_source("wide-except:python-docs, linux-docs") == ("wide", ("python-docs", "linux-docs"))
    assert named_source("runs/my_text.txt") == (None, ())
    with pytest.raises(ValueError, match="name the wide corpus's sources"):
        named_source("wide-except:")


def test_the_grid_s_oracle_puts_the_dense_ffn_back_where_asked(tmp_path):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from bench_insertion_grid import oracle_gaps

    dense = dense_model()
    ids = calib_ids()
    stem, _ = fit(dense, ids, tmp_path, layers="1,2")
    counts = torch.bincount(ids.reshape(-1), minlength=V)
    stream = torch.randint(0, V, (2 * 2 * 16 + 1,), generator=torch.Generator().manual_seed(3))

    def loss(model, hook=None):
        total = 0.0
        for a in range(0, len(stream) - 1, 32):
            total += float(model(stream[a:a + 32].reshape(2, 16), targets=stream[a + 1:a + 33].reshape(2, 16)))
        return total / 2

    with torch.no_grad():
        base = {"held": loss(dense)}
        gaps = oracle_gaps(stem, dense, {"held": stream}, counts, [1, 2], base, batch=(2, 16))["held"]
        assert gaps["plain"] == pytest.approx(loss(stem) - base["held"], abs=1e-5) and abs(gaps["plain"]) > 1e-3
        assert gaps["all"] == pytest.approx(0.0, abs=1e-5)  # the dense FFN everywhere: the dense model
        assert gaps["rare<1"] != pytest.approx(gaps["plain"], abs=1e-6)  # the last 10 ids are never seen
        assert gaps["positions"]["rare<1"] == pytest.approx(float((counts[stream[:-1]] < 1).double().mean()))
        assert gaps["plain"] == pytest.approx(loss(stem) - base["held"], abs=1e-5)  # the hooks are gone
