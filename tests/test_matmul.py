"""oneDNN GEMMs (run.matmul): same values and gradients as ATen, clear fallbacks and errors."""

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from train_helpers import debug_config, losses, make_token_data, one_thread  # noqa: F401

from stemlm.runtime import matmul
from stemlm.config import ConfigError, ModelConfig
from stemlm.model.loss import linear_cross_entropy
from stemlm.runtime.matmul import (OneDNNLinear, mm_nn, mm_nt, onednn_available, onednn_linear, resolve_matmul_backend,
                           use_matmul_backend)
from stemlm.model.decoder import StemLM
from stemlm.train import Trainer, train
from stemlm.train.evaluate import evaluate_checkpoint

needs_onednn = pytest.mark.skipif(not onednn_available(), reason="this PyTorch build has no oneDNN")


def _grads(fn, *tensors):
    leaves = [t.clone().requires_grad_() for t in tensors]
    out = fn(*leaves)
    out.backward(torch.linspace(-1, 1, out.numel()).view_as(out))  # a non-trivial upstream gradient
    return [out.detach()] + [t.grad for t in leaves]


@needs_onednn
@pytest.mark.parametrize("out", [12, 40])  # narrower and wider than the input: both orders of the weight gradient
@pytest.mark.parametrize("shape", [(7, 16), (2, 33, 16), (1, 1, 16)])
def test_onednn_linear_matches_aten_values_and_gradients(shape, out):
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(*shape, generator=gen), torch.randn(out, 16, generator=gen)
    for got, ref in zip(_grads(onednn_linear, x, w), _grads(F.linear, x, w)):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@needs_onednn
def test_products_match_aten_and_accept_transposed_views():
    gen = torch.Generator().manual_seed(1)
    a, b = torch.randn(9, 20, generator=gen), torch.randn(20, 11, generator=gen)
    torch.testing.assert_close(mm_nn(a, b, "onednn"), a @ b, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mm_nt(a, b.t(), "onednn"), a @ b, rtol=1e-5, atol=1e-5)  # b.t() is a strided view


@needs_onednn
@pytest.mark.parametrize("mode", matmul.WEIGHT_GRADS)
@pytest.mark.parametrize("out, inp", [(40, 16), (16, 40), (16, 16)])
def test_weight_gradient_in_every_mode_equals_aten(monkeypatch, mode, out, inp):
    gen = torch.Generator().manual_seed(4)
    grad, x = torch.randn(50, out, generator=gen), torch.randn(50, inp, generator=gen)
    monkeypatch.setattr(matmul, "WEIGHT_GRAD", mode)
    got = matmul.weight_grad(grad, x, "onednn")
    assert got.shape == (out, inp) and got.is_contiguous()
    torch.testing.assert_close(got, grad.t() @ x, rtol=1e-5, atol=1e-5)


def test_falls_back_to_aten_off_the_fp32_cpu_path():
    gen = torch.Generator().manual_seed(2)
    x, w = torch.randn(4, 8, generator=gen), torch.randn(6, 8, generator=gen)
    xb, wb = x.bfloat16(), w.bfloat16()
    assert torch.equal(onednn_linear(xb, wb), F.linear(xb, wb))  # bf16: ATen
    assert torch.equal(mm_nt(xb, wb, "onednn"), xb @ wb.t())
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast keeps its own dtype policy
        got, ref = onednn_linear(x, w), F.linear(x, w)
        assert got.dtype == ref.dtype == torch.bfloat16 and torch.equal(got, ref)
    assert torch.equal(mm_nn(x, w.t(), "aten"), x @ w.t())


@needs_onednn
def test_chunked_loss_on_onednn_matches_aten():
    gen = torch.Generator().manual_seed(3)
    hidden, weight = torch.randn(2, 40, 16, generator=gen), torch.randn(97, 16, generator=gen)
    targets = torch.randint(0, 97, (2, 40), generator=gen)
    targets[1, :3] = -100

    def run(backend):
        return _grads(lambda h, w: 3.0 * linear_cross_entropy(h, w, targets, chunk=13, backend=backend), hidden, weight)
    for got, ref in zip(run("onednn"), run("aten")):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)


@needs_onednn
def test_use_matmul_backend_keeps_parameters_and_outputs():
    torch.manual_seed(0)
    model = StemLM(ModelConfig(vocab_size=64, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, d_ff=48,
                               max_seq_len=16, stem_layers="1/3"))
    ids = torch.randint(0, 64, (2, 10))
    names, ref_logits, ref_loss = list(model.state_dict()), model(ids), model(ids, targets=ids)
    n_linear = sum(isinstance(m, nn.Linear) for m in model.modules())
    assert use_matmul_backend(model, "onednn") == n_linear
    assert all(type(m) is OneDNNLinear for m in model.modules() if isinstance(m, nn.Linear))
    assert list(model.state_dict()) == names
    torch.testing.assert_close(model(ids), ref_logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(model(ids, targets=ids), ref_loss, rtol=1e-5, atol=1e-6)
    assert use_matmul_backend(model, "aten") == n_linear
    assert all(type(m) is nn.Linear for m in model.modules() if isinstance(m, nn.Linear))
    with pytest.raises(ValueError, match="aten or onednn"):
        use_matmul_backend(model, "auto")


def test_resolve_backend_rules_and_errors(monkeypatch):
    assert resolve_matmul_backend("aten", "cpu") == "aten"
    assert resolve_matmul_backend("auto", "cpu", "bfloat16") == "aten"
    assert resolve_matmul_backend("auto", "cuda") == "aten"
    with pytest.raises(ValueError, match="CPU only"):
        resolve_matmul_backend("onednn", "cuda")
    with pytest.raises(ValueError, match="one of"):
        resolve_matmul_backend("mkl", "cpu")
    monkeypatch.setattr(matmul, "onednn_available", lambda: False)
    assert resolve_matmul_backend("auto", "cpu") == "aten"
    with pytest.raises(ValueError, match="no oneDNN"):
        resolve_matmul_backend("onednn", "cpu")


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return make_token_data(tmp_path_factory.mktemp("data"))


@needs_onednn
def test_training_on_onednn_matches_aten_losses(data_dir, tmp_path):
    for backend in ("aten", "onednn"):
        train(debug_config(data_dir, tmp_path / backend, "run.steps=4", f"run.matmul={backend}"))
    np.testing.assert_allclose(losses(tmp_path / "onednn"), losses(tmp_path / "aten"), rtol=1e-5)
    evals = [evaluate_checkpoint(tmp_path / "aten", batches=2, matmul=m)["loss"] for m in ("aten", "onednn")]
    assert evals[1] == pytest.approx(evals[0], rel=1e-5)


def test_unavailable_onednn_is_a_clear_config_error(data_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(matmul, "onednn_available", lambda: False)
    with pytest.raises(ConfigError, match="no oneDNN"):
        Trainer(debug_config(data_dir, tmp_path / "run", "run.matmul=onednn"))
    with pytest.raises(ConfigError, match="run.matmul"):
        debug_config(data_dir, tmp_path / "run", "run.matmul=mkl")
