"""The training loop on the debug preset: learning, determinism, exact resume, clear failures."""

import json

import numpy as np
import pytest
import torch
from train_helpers import debug_config, losses, make_token_data, one_thread  # noqa: F401

from stemlm.store import open_model
from stemlm.config import ConfigError
from stemlm.train import Trainer, TrainingDiverged, train
from stemlm.train import loop as loop_mod
from stemlm.train.evaluate import evaluate_checkpoint
from stemlm.train.state import list_checkpoints


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return make_token_data(tmp_path_factory.mktemp("data"))


def test_loss_decreases_and_run_dir_is_complete(data_dir, tmp_path):
    out = tmp_path / "run"
    result = train(debug_config(data_dir, out, "run.steps=40", "run.plots=true", "optim.lr=1e-2"))
    got = losses(out)
    assert len(got) == 40 and np.mean(got[-5:]) < np.mean(got[:5]) - 0.5
    assert result.val_loss < got[0] - 0.5
    rec = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    for key in ("step", "loss", "lr", "grad_norm", "tokens_per_s", "mfu", "unique_tokens", "tokens_seen",
                "flops_seen", "val_loss", "loss_spikes"):
        assert key in rec, key
    assert rec["tokens_seen"] == 40 * 4 * 32 and 0 < rec["unique_tokens"] <= 4 * 32
    for name in ("config.yaml", "loss_vs_tokens.png", "loss_vs_flops.png", "summary.json"):
        assert (out / name).exists(), name
    ckpt = list_checkpoints(out)[-1]
    assert len(list_checkpoints(out)) == 2  # keep_last
    model = open_model(ckpt)  # a normal stemlm checkpoint
    assert model.cfg.vocab_size == 512 and model.cfg.layer_kinds[2] == "stem"
    ev = evaluate_checkpoint(out, batches=2)
    assert ev["loss"] == pytest.approx(result.val_loss, rel=0.2)


def test_same_seed_same_losses(data_dir, tmp_path):
    train(debug_config(data_dir, tmp_path / "a", "run.steps=6"))
    train(debug_config(data_dir, tmp_path / "b", "run.steps=6"))
    assert losses(tmp_path / "a") == losses(tmp_path / "b")


@pytest.mark.parametrize("table_optimizer", ["sparse", "dense"])
def test_resume_is_bit_identical(data_dir, tmp_path, table_optimizer):
    args = ("run.steps=12", "run.ckpt_every=100", "run.eval_every=4", "optim.grad_accum=2",
            f"optim.table_optimizer={table_optimizer}", "optim.table_weight_decay=0.1")
    train(debug_config(data_dir, tmp_path / "full", *args))
    train(debug_config(data_dir, tmp_path / "split", *args), stop_at=5)
    assert len(losses(tmp_path / "split")) == 5
    train(debug_config(data_dir, tmp_path / "split", *args), resume=True)
    assert losses(tmp_path / "split") == losses(tmp_path / "full")  # exact float equality
    assert losses(tmp_path / "split", "val_loss") == losses(tmp_path / "full", "val_loss")
    a = open_model(tmp_path / "full").state_dict()
    b = open_model(tmp_path / "split").state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_config_change_on_resume_is_an_error(data_dir, tmp_path):
    train(debug_config(data_dir, tmp_path, "run.steps=8"), stop_at=2)
    with pytest.raises(ConfigError, match="config changed on resume.*optim.lr"):
        train(debug_config(data_dir, tmp_path, "run.steps=8", "optim.lr=1e-4"), resume=True)
    with pytest.raises(FileExistsError, match="--resume"):
        train(debug_config(data_dir, tmp_path, "run.steps=8"))
    train(debug_config(data_dir, tmp_path, "run.steps=10"), resume=True)  # run.steps may change


class _InfGrad(torch.autograd.Function):
    """Identity forward (a finite loss), infinite gradient backward."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * float("inf")


@pytest.mark.parametrize("poison, message", [
    (lambda loss: loss * float("nan"), "loss is nan"),
    (lambda loss: loss * float("inf"), "loss is inf"),
    (_InfGrad.apply, "gradient norm is (inf|nan)"),
])
def test_non_finite_step_stops_and_keeps_checkpoint(data_dir, tmp_path, monkeypatch, poison, message):
    train(debug_config(data_dir, tmp_path, "run.steps=10", "run.ckpt_every=3"), stop_at=3)
    ckpt = list_checkpoints(tmp_path)[-1]
    before = (ckpt / "model.safetensors").read_bytes()
    real = loop_mod.evaluate_mod.compute_loss
    calls = {"n": 0}

    def poisoned(model, batch, doc_masking=False):
        calls["n"] += 1
        loss = real(model, batch, doc_masking)
        return poison(loss) if calls["n"] == 2 else loss

    monkeypatch.setattr(loop_mod.evaluate_mod, "compute_loss", poisoned)
    with pytest.raises(TrainingDiverged, match=rf"{message} at step 5.*step_00000003 is intact"):
        train(debug_config(data_dir, tmp_path, "run.steps=10", "run.ckpt_every=3"), resume=True)
    assert list_checkpoints(tmp_path) == [ckpt] and (ckpt / "model.safetensors").read_bytes() == before


def test_missing_and_corrupt_data_errors(data_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Trainer(debug_config(tmp_path / "nowhere", tmp_path / "run"))
    bad = make_token_data(tmp_path / "bad")
    with open(bad / "train.bin", "r+b") as f:
        f.truncate(100)
    with pytest.raises(ValueError, match="truncated or corrupt"):
        Trainer(debug_config(bad, tmp_path / "run"))


def test_vocab_too_small_for_data_is_an_error(data_dir, tmp_path):
    with pytest.raises(ValueError, match="vocab_size 512 exceeds model.vocab_size 256"):
        Trainer(debug_config(data_dir, tmp_path, "model.vocab_size=256"))


def test_token_id_out_of_range_is_an_error(data_dir, tmp_path):
    trainer = Trainer(debug_config(data_dir, tmp_path))
    trainer.model.cfg.__dict__["vocab_size"] = 30  # a model narrower than its data, past the setup check
    with pytest.raises(IndexError, match="out of range for a vocabulary of 30"):
        trainer.train_step()


@pytest.mark.parametrize("ffn", ["dense", "stem", "stem_dagger", "stem_gate", "hash_moe"])
def test_every_ffn_kind_trains(data_dir, tmp_path, ffn):
    trainer = Trainer(debug_config(data_dir, tmp_path, f"model.ffn={ffn}", "model.stem_layers=1/2"))
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    rec = trainer.train_step()
    assert np.isfinite(rec["loss"]) and rec["grad_norm"] > 0
    after = trainer.model.state_dict()
    assert all(not torch.equal(before[k], after[k]) for k in before if not k.endswith("expert_of_token"))


def test_bf16_autocast_and_midtrain_from_checkpoint(data_dir, tmp_path):
    train(debug_config(data_dir, tmp_path / "base", "run.steps=3"))
    trainer = Trainer(debug_config(data_dir, tmp_path / "mid", "run.stage=midtrain", "run.dtype=bfloat16",
                                   f"run.init_from={tmp_path / 'base'}", "model.max_seq_len=64"))
    base = open_model(tmp_path / "base").state_dict()
    assert trainer.model.cfg.max_seq_len == 64
    assert all(torch.equal(v, base[k]) for k, v in trainer.model.state_dict().items())
    assert np.isfinite(trainer.train_step()["loss"])


def test_context_extend_stage_with_document_masking(data_dir, tmp_path):
    train(debug_config(data_dir, tmp_path / "base", "run.steps=2", "data.seq_len=32"))
    cfg = debug_config(data_dir, tmp_path / "long", "run.stage=context_extend", f"run.init_from={tmp_path / 'base'}",
                       "model.max_seq_len=128", "model.rope_theta=100000", "data.seq_len=96", "data.doc_masking=true",
                       "run.steps=2")
    trainer = Trainer(cfg)
    base = open_model(tmp_path / "base").state_dict()
    assert trainer.model.cfg.max_seq_len == 128 and trainer.model.cfg.rope_theta == 100000
    assert all(torch.equal(v, base[k]) for k, v in trainer.model.state_dict().items())
    batch = trainer.batch(0)
    assert batch.inputs.shape[1] == 96 and len(batch.doc_ids.unique()) > 1  # sequences cross documents
    masked = loop_mod.evaluate_mod.compute_loss(trainer.model, batch, doc_masking=True)
    assert not torch.allclose(masked, loop_mod.evaluate_mod.compute_loss(trainer.model, batch, doc_masking=False))
    trainer.close()  # its lock on the run dir: one writer at a time
    result = train(cfg)
    assert result.steps == 2 and np.isfinite(result.val_loss)


def test_compile_runs_each_block_compiled_with_eager_losses_and_names(data_dir, tmp_path):
    args = ("run.steps=3", "model.stem_layers=1/2")
    train(debug_config(data_dir, tmp_path / "eager", *args))
    trainer = Trainer(debug_config(data_dir, tmp_path / "compiled", *args, "run.compile=true"))
    assert all(block._compiled_call_impl is not None for block in trainer.model.layers)
    trainer.fit()
    np.testing.assert_allclose(losses(tmp_path / "compiled"), losses(tmp_path / "eager"), rtol=1e-4)
    eager, compiled = open_model(tmp_path / "eager").state_dict(), open_model(tmp_path / "compiled").state_dict()
    assert compiled.keys() == eager.keys()  # same checkpoint names: no "_orig_mod." prefixes
    for k in eager:
        torch.testing.assert_close(compiled[k], eager[k], rtol=1e-3, atol=1e-4)


def test_bf16_training_on_the_cpu_reads_mfu_against_a_bf16_probe(tmp_path):
    """Under bf16 autocast the GEMMs run in bf16, so the peak is a bf16 matmul probe on the CPU too (it was the
    fp32 probe, and an autocast run on a CPU with native bf16 logged an MFU of ~0.96); fp32 keeps its probe, and
    the run dir caches each dtype's peak apart."""
    from stemlm.train.metrics import peak_flops_for_run, peak_for

    peak, probe = peak_for(torch.device("cpu"), "bfloat16")
    assert peak > 0 and probe == "bf16 matmul 1024^3 probe on cpu"
    assert peak_for(torch.device("cpu"), "float32")[1] == "fp32 matmul 1024^3, best of ATen and oneDNN"
    cpu = torch.device("cpu")
    peak_flops_for_run(tmp_path, cpu, None, "bfloat16")
    assert "bf16" in json.loads((tmp_path / "peak_flops.json").read_text())["probe"]
    peak_flops_for_run(tmp_path, cpu, None, "float32")  # another dtype: probed again, not read from the cache
    assert json.loads((tmp_path / "peak_flops.json").read_text())["dtype"] == "float32"
