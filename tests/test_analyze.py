"""Analyses: Heaps' law fit, unique-token curves, pairwise cosine geometry, analyze CLI."""

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from stemlm import StemLM, model_config
from stemlm.analyze.capacity import capacity, context_lengths, fit_heaps, unique_curve
from stemlm.analyze.geometry import capture_ffn_inputs, geometry, pairwise_cos, summarize
from stemlm.analyze.text import windows
from stemlm.checkpoint.directory import save_model
from stemlm.cli import main
from stemlm.data import write_token_split
from stemlm.version import git_commit


def test_heaps_fit_recovers_k_and_beta():
    rng = np.random.default_rng(0)
    n = np.array(context_lengths(1 << 14))
    for k, beta in [(3.0, 0.6), (0.8, 0.85)]:
        u = k * n ** beta * np.exp(rng.normal(0, 0.01, size=n.shape))
        fit = fit_heaps(n, u)
        assert abs(fit.K - k) / k < 0.05 and abs(fit.beta - beta) < 0.01 and fit.r2 > 0.999
    with pytest.raises(ValueError, match="positive"):
        fit_heaps(np.array([1, 2]), np.array([0, 1]))


def test_unique_curve_on_known_streams():
    assert unique_curve(np.arange(1000), [10, 100], n_windows=4).tolist() == [10, 100]
    assert unique_curve(np.arange(1000) % 7, [10, 100], n_windows=4).tolist() == [7, 7]
    res = capacity(np.arange(4096) % 300, n_table_layers=2, d_ff=8, d_model=4, max_len=1024, n_windows=4)
    assert res["context_length"][-1] == 1024 and res["unique_tokens"][-1] == 300
    assert res["stem_params_activated"][-1] == 2 * 8 * 300 and res["first_length_exceeding_dense"] == 8


def test_windows_are_seeded_and_in_range():
    stream = np.arange(500)
    a, b = windows(stream, 50, 6, seed=1), windows(stream, 50, 6, seed=1)
    assert np.array_equal(a, b) and a.shape == (6, 50)
    assert (np.diff(a, axis=1) == 1).all() and a.max() < 500
    with pytest.raises(ValueError, match="longer than"):
        windows(stream, 501, 1)


def test_pairwise_cos_matches_naive_loop():
    v = torch.randn(7, 5)
    got = pairwise_cos(v)
    want = torch.tensor([F.cosine_similarity(v[i], v[j], dim=0) for i in range(7) for j in range(i + 1, 7)])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    eye = summarize(pairwise_cos(torch.eye(6)))
    assert eye["mean_abs"] == 0 and eye["n_pairs"] == 15 and sum(eye["hist"]) == 15
    assert summarize(pairwise_cos(torch.ones(4, 3)))["p50"] == pytest.approx(1.0)


def test_geometry_on_tiny_models():
    model = StemLM(model_config("debug", ffn="stem", stem_layers="1/2")).eval()
    dense = StemLM(model_config("debug", ffn="dense")).eval()
    ids = torch.randint(0, 100, (2, 16))
    res = geometry(model, ids, dense=dense, max_points=5000)
    kinds = {layer["layer"]: set(k for k, v in layer.items() if isinstance(v, dict)) for layer in res["layers"]}
    assert kinds[0] == {"up_proj", "dense_up_proj"} and kinds[1] == {"stem_rows", "gated", "dense_up_proj"}
    uniq = torch.unique(ids)
    want = summarize(pairwise_cos(model.tables["1"].weight.detach()[uniq]))
    assert res["layers"][1]["stem_rows"]["mean_abs"] == pytest.approx(want["mean_abs"])
    assert res["n_positions"] == 32 and res["n_unique_tokens"] == len(uniq)
    assert all(not layer.ffn._forward_hooks for layer in model.layers)  # hooks removed


def test_captured_inputs_reproduce_the_ffn_output():
    model = StemLM(model_config("debug", ffn="stem", stem_layers="full")).eval()
    ids = torch.randint(0, 100, (1, 9))
    xs = capture_ffn_inputs(model, ids, [2])
    ffn, rows = model.layers[2].ffn, model.tables["2"].weight.detach()[ids]
    gated = F.silu(xs[2] @ ffn.w_gate.weight.T) * rows
    torch.testing.assert_close(ffn.w_down(gated), ffn(xs[2], rows=rows), rtol=1e-5, atol=1e-6)


def test_analyze_cli_writes_json_and_png(tmp_path):
    cfg = model_config("debug", ffn="stem", stem_layers="1/2")
    save_model(StemLM(cfg), tmp_path / "ckpt")
    rng = np.random.default_rng(0)
    data = tmp_path / "data"
    write_token_split(data, "val", [rng.integers(1, 300, size=200) for _ in range(20)], cfg.vocab_size, 0)
    out = tmp_path / "out"
    assert main(["analyze", "capacity", "--ckpt", str(tmp_path / "ckpt"), "--data", str(data), "--out", str(out),
                 "--max-len", "512", "--windows", "4"]) == 0
    res = json.loads((out / "capacity.json").read_text())
    assert res["n_table_layers"] == 2 and 0 < res["heaps"]["beta"] <= 1 and (out / "capacity.png").stat().st_size > 0
    assert res["git_commit"] == git_commit()
    assert main(["analyze", "geometry", "--ckpt", str(tmp_path / "ckpt"), "--data", str(data), "--out", str(out),
                 "--seqs", "2", "--seq-len", "32"]) == 0
    assert len(json.loads((out / "geometry.json").read_text())["layers"]) == cfg.n_layers
    assert (out / "geometry.png").stat().st_size > 0
