"""``optim.embed_lr``: the input embedding's own peak lr (0 = frozen), other groups unchanged."""

import pytest
import torch
from train_helpers import debug_config, make_token_data, one_thread  # noqa: F401

from stemlm.store import open_model
from stemlm.config import ConfigError
from stemlm.model.decoder import StemLM
from stemlm.presets import model_config
from stemlm.train import Trainer, load_train_config
from stemlm.train.optim import build_optimizers
from stemlm.train.state import list_checkpoints


def _groups(model, *overrides):
    opt, _ = build_optimizers(model, load_train_config("debug", None, list(overrides)).optim)
    return {g["name"]: g for g in opt.param_groups}


def test_embed_group_only_when_set():
    torch.manual_seed(0)
    model = StemLM(model_config("debug", vocab_size=64))
    emb = model.tok_embeddings.weight
    default = _groups(model)
    assert "embed" not in default and any(p is emb for p in default["decay"]["params"])
    groups = _groups(model, "optim.lr=1e-3", "optim.embed_lr=1e-4")
    assert [p for p in groups["embed"]["params"]] == [emb]
    assert groups["embed"]["peak_lr"] == pytest.approx(1e-4) and groups["decay"]["peak_lr"] == pytest.approx(1e-3)
    assert all(p is not emb for p in groups["decay"]["params"])
    assert groups["embed"]["weight_decay"] == groups["decay"]["weight_decay"]


def test_negative_embed_lr_is_an_error():
    with pytest.raises(ConfigError, match="embed_lr"):
        load_train_config("debug", None, ["optim.embed_lr=-1e-3"])


def test_zero_embed_lr_freezes_the_embedding(tmp_path):
    data = make_token_data(tmp_path / "data")
    out = tmp_path / "run"
    trainer = Trainer(debug_config(data, out, "run.steps=8", "optim.embed_lr=0", "optim.lr=1e-2"))
    emb, head = (trainer.model.tok_embeddings.weight.detach().clone(), trainer.model.lm_head.weight.detach().clone())
    trainer.fit()
    trained = open_model(list_checkpoints(out)[-1])
    assert torch.equal(trained.tok_embeddings.weight, emb)
    assert not torch.equal(trained.lm_head.weight, head)  # the rest trained
