"""run.matmul=auto on a CPU: the probe times both GEMM backends at the run's shapes, keeps the faster past a
margin, caches the choice per machine and shape, and the trainer uses and reports what it chose."""

import json
import shutil

import pytest
import torch
from train_helpers import debug_config, make_token_data

from stemlm import model_config
from stemlm.model.decoder import StemLM
from stemlm.runtime import matmul_probe
from stemlm.runtime.matmul import OneDNNLinear, onednn_available
from stemlm.runtime.matmul_probe import ONEDNN_MARGIN, MatmulChoice, choose_matmul, linear_shapes, probe_matmul
from stemlm.train import Trainer, train

needs_onednn = pytest.mark.skipif(not onednn_available(), reason="this PyTorch build has no oneDNN")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("STEMLM_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / matmul_probe.CACHE_KIND


def test_linear_shapes_count_every_bias_free_linear():
    cfg = model_config("debug", ffn="dense")
    shapes = linear_shapes(StemLM(cfg))
    d, f, kv = cfg.d_model, cfg.d_ff, cfg.n_kv_heads * cfg.d_model // cfg.n_heads
    assert shapes[(d, f)] == 2 * cfg.n_layers and shapes[(f, d)] == cfg.n_layers  # gate+up, down
    assert shapes[(d, cfg.vocab_size)] == 1  # the LM head
    assert sum(shapes.values()) == 7 * cfg.n_layers + 1 and (d, kv) in shapes


@pytest.mark.parametrize("aten_over_onednn, expected", [(1.0, "aten"), (ONEDNN_MARGIN - 0.02, "aten"),
                                                         (ONEDNN_MARGIN + 0.02, "onednn"), (0.5, "aten")])
def test_onednn_only_past_the_margin(monkeypatch, aten_over_onednn, expected):
    times = {"aten": aten_over_onednn, "onednn": 1.0}
    monkeypatch.setattr(matmul_probe, "_time_backend", lambda operands, backend: times[backend])
    choice = probe_matmul(linear_shapes(StemLM(model_config("debug"))), rows=64)
    assert choice.backend == expected and (choice.aten_s, choice.onednn_s) == (aten_over_onednn, 1.0)


@needs_onednn
def test_probe_measures_both_and_leaves_the_global_rng_alone():
    shapes = linear_shapes(StemLM(model_config("debug")))
    state = torch.get_rng_state()
    choice = probe_matmul(shapes, rows=10_000)
    assert torch.equal(torch.get_rng_state(), state)
    assert choice.aten_s > 0 and choice.onednn_s > 0 and choice.rows == matmul_probe.MAX_ROWS
    assert choice.backend == ("onednn" if choice.aten_s >= ONEDNN_MARGIN * choice.onednn_s else "aten")


def test_choice_is_cached_per_machine_and_shape(cache, monkeypatch):
    calls = []

    def fake_probe(shapes, rows):
        calls.append(rows)
        return MatmulChoice("onednn", 2.0, 1.0, rows)

    monkeypatch.setattr(matmul_probe, "probe_matmul", fake_probe)
    model = StemLM(model_config("debug"))
    first, again, other_rows = choose_matmul(model, 64), choose_matmul(model, 64), choose_matmul(model, 128)
    assert calls == [64, 128] and not first.cached and again.cached and not other_rows.cached
    assert again.backend == first.backend == "onednn" and again.aten_s == 2.0
    files = {json.loads(f.read_text())["key"]: f for f in cache.glob("*.json")}  # one file per machine and shape
    assert len(files) == 2 and all(matmul_probe.machine_key() in k and k.startswith("probe v") for k in files)
    for f in files.values():
        f.write_text("{ not json")  # a corrupt cache is measured again and rewritten, not an error
    assert not choose_matmul(model, 64).cached and calls == [64, 128, 64] and choose_matmul(model, 64).cached


@needs_onednn
def test_trainer_auto_applies_and_reports_the_probed_backend(tmp_path, cache, monkeypatch):
    data_dir = make_token_data(tmp_path / "data")
    for backend in ("onednn", "aten"):
        monkeypatch.setattr(matmul_probe, "probe_matmul", lambda shapes, rows, b=backend: MatmulChoice(b, 1.0, 1.0, rows))
        shutil.rmtree(cache, ignore_errors=True)
        cfg = debug_config(data_dir, tmp_path / backend, "run.steps=1")
        assert cfg.run.matmul == "auto"  # the default
        with Trainer(cfg) as trainer:
            assert trainer.matmul_backend == backend
            assert isinstance(trainer.model.lm_head, OneDNNLinear) == (backend == "onednn")
        assert train(cfg).matmul == backend
        assert json.loads((tmp_path / backend / "summary.json").read_text())["matmul"] == backend
    explicit = debug_config(data_dir, tmp_path / "explicit", "run.matmul=aten")
    monkeypatch.setattr(matmul_probe, "probe_matmul", lambda *a: pytest.fail("an explicit backend is not probed"))
    with Trainer(explicit) as trainer:
        assert trainer.matmul_backend == "aten"
