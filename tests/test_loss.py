"""The chunked LM-head cross-entropy equals the plain one: values, gradients, ignore_index, autocast."""

import pytest
import torch
import torch.nn.functional as F

from stemlm.config import ModelConfig
from stemlm.model.loss import IGNORE_INDEX, linear_cross_entropy
from stemlm.model.decoder import StemLM


def reference_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The plain path (full logits, ``F.cross_entropy``), for tests and comparisons."""
    logits = hidden.reshape(-1, hidden.shape[-1]) @ weight.t()  # (N, V)
    return F.cross_entropy(logits.float(), targets.reshape(-1), ignore_index=IGNORE_INDEX)


def _loss_and_grads(fn, hidden, weight, targets, upstream=3.0, **kw):
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = fn(h, w, targets, **kw)
    (upstream * loss).backward()  # 3.0: a non-unit upstream gradient
    return loss.detach(), h.grad, w.grad


@pytest.mark.parametrize("upstream", [1.0, -0.5])
def test_gradients_follow_the_upstream_gradient(upstream):
    gen = torch.Generator().manual_seed(5)
    hidden, weight = torch.randn(30, 16, generator=gen), torch.randn(41, 16, generator=gen)
    targets = torch.randint(0, 41, (30,), generator=gen)
    ref = _loss_and_grads(reference_cross_entropy, hidden, weight, targets, upstream)
    got = _loss_and_grads(linear_cross_entropy, hidden, weight, targets, upstream, chunk=8)
    for a, b in zip(ref, got):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("chunk", [None, 1, 7, 64, 1000])
def test_matches_plain_cross_entropy(chunk):
    gen = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(2, 50, 16, generator=gen), torch.randn(97, 16, generator=gen)
    targets = torch.randint(0, 97, (2, 50), generator=gen)
    targets[0, :5] = -100  # ignored positions
    ref = _loss_and_grads(reference_cross_entropy, hidden, weight, targets)
    got = _loss_and_grads(linear_cross_entropy, hidden, weight, targets, chunk=chunk)
    for a, b in zip(ref, got):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    assert got[1][0, :5].abs().max() == 0  # ignored positions get no gradient


def test_no_grad_and_all_ignored():
    hidden, weight = torch.randn(4, 8), torch.randn(11, 8)
    with torch.no_grad():
        loss = linear_cross_entropy(hidden, weight, torch.tensor([1, 2, 3, 4]))
    torch.testing.assert_close(loss, reference_cross_entropy(hidden, weight, torch.tensor([1, 2, 3, 4])))
    assert linear_cross_entropy(hidden, weight, torch.full((4,), -100)).item() == 0.0


def test_no_grad_forms_no_gradient_products(monkeypatch):
    """Under torch.no_grad only the logits product runs (validation, eval-ppl, eval pay no backward)."""
    import stemlm.model.loss as loss_mod

    calls = {"nt": 0, "nn": 0}
    real_nt, real_nn = loss_mod.mm_nt, loss_mod.mm_nn
    monkeypatch.setattr(loss_mod, "mm_nt", lambda *a: calls.__setitem__("nt", calls["nt"] + 1) or real_nt(*a))
    monkeypatch.setattr(loss_mod, "mm_nn", lambda *a: calls.__setitem__("nn", calls["nn"] + 1) or real_nn(*a))
    hidden, weight = torch.randn(6, 8, requires_grad=True), torch.randn(11, 8, requires_grad=True)
    targets = torch.tensor([1, 2, 3, 4, 5, 6])
    with torch.no_grad():
        loss = linear_cross_entropy(hidden, weight, targets, chunk=2)
    assert calls == {"nt": 3, "nn": 0} and loss.grad_fn is None
    torch.testing.assert_close(loss, reference_cross_entropy(hidden, weight, targets).detach())
    linear_cross_entropy(hidden, weight, targets, chunk=2).backward()  # with grad: the gradient products run
    assert calls["nn"] == 3 and hidden.grad is not None


def test_shape_mismatch_is_refused():
    with pytest.raises(ValueError, match="3 hidden states but 4 targets"):
        linear_cross_entropy(torch.randn(3, 8), torch.randn(11, 8), torch.zeros(4, dtype=torch.long))


def test_model_loss_path_equals_logits_path():
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, d_ff=48, max_seq_len=32,
                      ffn="stem", stem_layers="1/2")
    torch.manual_seed(0)
    model = StemLM(cfg)
    ids, targets = torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))
    fused = model(ids, targets=targets)
    fused.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    plain = F.cross_entropy(model(ids).view(-1, 64), targets.view(-1))
    plain.backward()
    torch.testing.assert_close(fused, plain, rtol=1e-6, atol=1e-6)
    for n, p in model.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, rtol=1e-5, atol=1e-6, msg=n)


def test_bf16_autocast_runs_close():
    gen = torch.Generator().manual_seed(1)
    hidden, weight = torch.randn(32, 16, generator=gen), torch.randn(40, 16, generator=gen)
    targets = torch.randint(0, 40, (32,), generator=gen)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = _loss_and_grads(linear_cross_entropy, hidden, weight, targets, chunk=8)
    ref = _loss_and_grads(reference_cross_entropy, hidden, weight, targets)
    assert got[1].dtype == hidden.dtype and got[2].dtype == weight.dtype
    torch.testing.assert_close(got[0], ref[0], rtol=2e-2, atol=2e-2)
    for g, r in zip(got[1:], ref[1:]):  # both gradients, the head's summed over chunks in fp32
        assert float((g - r).norm() / r.norm()) < 2e-2


def test_head_gradient_product_runs_in_the_autocast_dtype(monkeypatch):
    """Under autocast the head-weight gradient's product is an out-of-place matmul (autocast casts it
    to bf16), not an in-place fp32 ``addmm_`` (which autocast never casts: fp32 SIMT on a GPU)."""
    calls = []
    real = torch.Tensor.addmm_
    monkeypatch.setattr(torch.Tensor, "addmm_", lambda self, *a, **k: calls.append(self.dtype) or real(self, *a, **k))
    gen = torch.Generator().manual_seed(2)
    hidden, weight = torch.randn(24, 16, generator=gen), torch.randn(40, 16, generator=gen)
    targets = torch.randint(0, 40, (24,), generator=gen)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _loss_and_grads(linear_cross_entropy, hidden, weight, targets, chunk=8)
    assert calls == []
    _loss_and_grads(linear_cross_entropy, hidden, weight, targets, chunk=8)  # fp32: the fused addmm_
    assert calls == [torch.float32] * 3
