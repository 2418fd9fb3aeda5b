"""Distillation from a frozen teacher during training (run.distill): the KL, determinism, resume, errors."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from train_helpers import debug_config, losses, make_token_data, one_thread  # noqa: F401

from stemlm.config import ConfigError
from stemlm.train import train
from stemlm.train.distill import DistillConfig, kd_kl


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return make_token_data(tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="module")
def teacher(data_dir, tmp_path_factory):
    """A dense debug model trained a little: a teacher whose distribution is not uniform."""
    out = tmp_path_factory.mktemp("teacher")
    train(debug_config(data_dir, out, "run.steps=10", "model.ffn=dense", "optim.lr=1e-2"))
    return out


def reference_kl(sh, sw, th, tw, targets, temperature, top_k=0):
    logq = F.log_softmax(sh @ sw.T / temperature, -1)
    t = th @ tw.T / temperature
    if top_k:
        t, idx = t.topk(top_k, -1)
        logq = logq.gather(1, idx)
    logp = F.log_softmax(t, -1)
    kl = (logp.exp() * (logp - logq)).sum(-1)
    valid = targets != -100
    return kl[valid].mean()


@pytest.mark.parametrize("top_k", [0, 5])
def test_chunked_kl_and_its_gradient_equal_the_plain_formula(top_k):
    g = torch.Generator().manual_seed(0)
    sh, th = torch.randn(37, 8, generator=g, requires_grad=True), torch.randn(37, 8, generator=g)
    sw, tw = torch.randn(50, 8, generator=g, requires_grad=True), torch.randn(50, 8, generator=g)
    targets = torch.randint(0, 50, (37,), generator=g)
    targets[::7] = -100
    got = kd_kl(sh, sw, th, tw, targets, temperature=2.0, top_k=top_k, chunk=10)
    grads = torch.autograd.grad(got, (sh, sw))
    want = reference_kl(sh, sw, th, tw, targets, 2.0, top_k)
    torch.testing.assert_close(got, want)
    for a, b in zip(grads, torch.autograd.grad(want, (sh, sw))):
        torch.testing.assert_close(a, b)


def test_kl_to_itself_is_zero_and_top_k_of_the_whole_vocabulary_is_the_full_kl():
    g = torch.Generator().manual_seed(1)
    h, w = torch.randn(20, 8, generator=g), torch.randn(30, 8, generator=g)
    targets = torch.zeros(20, dtype=torch.long)
    assert float(kd_kl(h, w, h, w, targets)) == pytest.approx(0.0, abs=1e-6)
    other = torch.randn(20, 8, generator=g)
    torch.testing.assert_close(kd_kl(h, w, other, w, targets, top_k=30), kd_kl(h, w, other, w, targets))


def test_distilled_runs_are_deterministic_and_resume_bit_identically(data_dir, teacher, tmp_path):
    args = ("run.steps=8", "run.ckpt_every=100", "run.eval_every=4", "optim.grad_accum=2", f"run.distill={teacher}",
            "run.distill_temperature=2.0", "run.distill_top_k=16")
    train(debug_config(data_dir, tmp_path / "a", *args))
    train(debug_config(data_dir, tmp_path / "b", *args))
    assert losses(tmp_path / "a") == losses(tmp_path / "b")  # exact float equality
    train(debug_config(data_dir, tmp_path / "split", *args), stop_at=3)
    train(debug_config(data_dir, tmp_path / "split", *args), resume=True)
    assert losses(tmp_path / "split") == losses(tmp_path / "a")
    assert losses(tmp_path / "split", "val_loss") == losses(tmp_path / "a", "val_loss")


def test_weight_zero_is_the_plain_run_and_the_teacher_moves_the_student(data_dir, teacher, tmp_path):
    train(debug_config(data_dir, tmp_path / "plain", "run.steps=6"))
    train(debug_config(data_dir, tmp_path / "w0", "run.steps=6", f"run.distill={teacher}", "run.distill_weight=0"))
    np.testing.assert_allclose(losses(tmp_path / "w0"), losses(tmp_path / "plain"), rtol=1e-5)
    train(debug_config(data_dir, tmp_path / "w1", "run.steps=6", f"run.distill={teacher}", "run.distill_weight=1"))
    assert losses(tmp_path / "w1")[1:] != losses(tmp_path / "plain")[1:]  # the KL alone drives it


def test_bad_distill_settings_are_one_line_errors(data_dir, teacher, tmp_path):
    for bad, match in [("run.distill_weight=1.5", "distill_weight"), ("run.distill_temperature=0", "temperature"),
                       ("run.distill_top_k=-1", "top_k"), ("run.distill_schedule=cosine", "distill_schedule")]:
        with pytest.raises(ConfigError, match=match):
            debug_config(data_dir, tmp_path, f"run.distill={teacher}", bad)
    with pytest.raises(ConfigError, match="run.distill: .*does not exist"):
        train(debug_config(data_dir, tmp_path / "x", f"run.distill={tmp_path / 'missing'}"))
    with pytest.raises(ConfigError, match="vocabulary"):
        train(debug_config(data_dir, tmp_path / "y", f"run.distill={teacher}", "model.vocab_size=600"))


def test_cached_top_k_teacher_trains_like_the_teacher_computed_on_the_fly(data_dir, teacher, tmp_path):
    """run.distill_cache writes the teacher's top-k of every micro-batch once (fp16 values), then trains
    without the teacher: the losses follow the on-the-fly top-k run; a resumed run reuses the files."""
    args = ("run.steps=6", "optim.grad_accum=2", f"run.distill={teacher}", "run.distill_top_k=8",
            "run.distill_weight=0.7", "run.distill_temperature=2.0")
    train(debug_config(data_dir, tmp_path / "live", *args))
    train(debug_config(data_dir, tmp_path / "cached", *args, "run.distill_cache=true"), stop_at=3)
    files = sorted((tmp_path / "cached" / "distill_topk").glob("*.safetensors"))
    assert len(files) == 12  # 6 steps x 2 micro-batches, all written before the first step
    stamps = [f.stat().st_mtime_ns for f in files]
    train(debug_config(data_dir, tmp_path / "cached", *args, "run.distill_cache=true"), resume=True)
    assert [f.stat().st_mtime_ns for f in files] == stamps
    np.testing.assert_allclose(losses(tmp_path / "cached"), losses(tmp_path / "live"), rtol=2e-3)
    with pytest.raises(ConfigError, match="distill_top_k > 0"):
        debug_config(data_dir, tmp_path / "x", f"run.distill={teacher}", "run.distill_cache=true")


def test_a_linear_schedule_starts_at_the_weight_ends_near_zero_and_resumes_bit_identically(data_dir, teacher, tmp_path):
    """run.distill_schedule=linear: w at step 0, w/2 half way, w/steps at the last step; its first step is the
    constant run's, the later ones differ; a run stopped and resumed reads the weight of its restored step."""
    linear, constant = DistillConfig("t", 0.6, schedule="linear"), DistillConfig("t", 0.6)
    assert [linear.weight_at(s, 6) for s in (0, 3, 5)] == pytest.approx([0.6, 0.3, 0.1])
    assert constant.weight_at(5, 6) == 0.6
    common = ("run.steps=6", "run.ckpt_every=100", f"run.distill={teacher}", "run.distill_weight=0.9")
    train(debug_config(data_dir, tmp_path / "const", *common))
    train(debug_config(data_dir, tmp_path / "lin", *common, "run.distill_schedule=linear"))
    const, lin = losses(tmp_path / "const"), losses(tmp_path / "lin")
    assert lin[0] == const[0] and lin[2:] != const[2:]  # the logged loss is the CE: step 1's update differs
    train(debug_config(data_dir, tmp_path / "split", *common, "run.distill_schedule=linear"), stop_at=3)
    train(debug_config(data_dir, tmp_path / "split", *common, "run.distill_schedule=linear"), resume=True)
    assert losses(tmp_path / "split") == lin
