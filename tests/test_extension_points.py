"""The extension points of docs/architecture.md take a new piece in the files they name.

* an FFN kind: its class (here, in this file) and its line in ``stemlm.ffn.KINDS``; config
  validation, placement, accounting, the table path, training, checkpoints and decoding read it;
* a storage tier: a backend and a ``Tier`` class with its line in ``TIER_CLASSES``; ``Placement``,
  ``open_model`` and the decode core serve a model from it, and the training loop trains on it
  (``run.tables``: the same ``TableStore``, through the table protocol).
"""

import pytest
import torch
import torch.nn.functional as F

from stemlm import StemLM, model_config
from stemlm import accounting as acc
from stemlm.ffn import KINDS, FFNKind
from stemlm.inference.generate import generate_ids
from stemlm.store import Placement, open_model
from stemlm.store import tiers as tiers_mod
from stemlm.store.backends import HostRows


class HalfStemFFN(FFNKind):
    """A toy kind: STEM whose row enters at half its value, ``W_d (SiLU(W_g x) ⊙ U[t] / 2)``."""

    name = "half_stem"
    holds = ("w_gate", "w_down")
    owns_table = True
    table_from = "w_up"

    @staticmethod
    def hidden(dense, x, rows):
        return F.silu(dense.w_gate(x)) * rows * 0.5


class CountingRows(HostRows):
    """A toy backend: host rows that count the rows they hand out."""

    gathered = 0

    def gather(self, ids):
        CountingRows.gathered += len(ids)
        return super().gather(ids)


class CountingTier(tiers_mod.HostTier):
    """A toy tier: the host tier over ``CountingRows``."""

    name = "counting"

    def from_rows(self, rows_fn, shape, codec, device, dtype):
        return CountingRows(rows_fn(0, shape[0]))

    def from_file(self, src, cfg, stored, codec, placement, device, dtype):
        return tiers_mod.Tier.from_file(self, src, cfg, stored, codec, placement, device, dtype)


@pytest.fixture
def half_stem(monkeypatch):
    monkeypatch.setitem(KINDS, HalfStemFFN.name, HalfStemFFN)  # its line in the registry
    return HalfStemFFN


def test_a_new_kind_is_known_everywhere_through_the_registry(half_stem, tmp_path):
    from stemlm.train import Trainer
    from train_helpers import debug_config, losses, make_token_data

    cfg = model_config("debug", ffn="half_stem", stem_layers="1/2")
    assert cfg.table_layers == cfg.stem_layer_ids and len(cfg.table_layers) == 2
    stem = model_config("debug", ffn="stem", stem_layers="1/2")
    assert acc.total_params(cfg) == acc.total_params(stem)  # same projections and tables as STEM
    assert acc.train_flops_per_token(cfg, 32) == acc.train_flops_per_token(stem, 32)
    model = StemLM(cfg)
    ref = StemLM(stem)
    ref.load_state_dict(model.state_dict())
    with torch.no_grad():  # the same weights, half the rows: equal to STEM with halved tables
        for t in ref.tables.values():
            t.weight.mul_(0.5)
    ids = torch.randint(0, cfg.vocab_size, (2, 7))
    torch.testing.assert_close(model(ids), ref(ids))
    data = make_token_data(tmp_path / "data")
    for path in ("reference", "fused"):
        with Trainer(debug_config(data, tmp_path / path, "model.ffn=half_stem", "model.stem_layers=1/2",
                                  "run.steps=2", f"run.table_path={path}")) as t:
            t.fit()
    assert losses(tmp_path / "fused") == losses(tmp_path / "reference")
    loaded = open_model(tmp_path / "fused")
    assert loaded.cfg.ffn == "half_stem" and generate_ids(loaded, ids[:1, :3], 4).shape == (1, 7)


def test_a_new_tier_serves_through_placement_and_open_model(monkeypatch, tmp_path):
    from stemlm.checkpoint.directory import save_model

    monkeypatch.setitem(tiers_mod.TIER_CLASSES, CountingTier.name, CountingTier)  # its line in the registry
    torch.manual_seed(0)
    model = StemLM(model_config("debug", ffn="stem", stem_layers="1/2")).eval()
    save_model(model, tmp_path / "ckpt")
    prompt = torch.randint(0, model.cfg.vocab_size, (1, 5))
    want = generate_ids(model, prompt, 6)
    CountingRows.gathered = 0
    served = open_model(tmp_path / "ckpt", Placement("counting"))
    with served.tables:
        assert served.tables.tier == "counting"
        assert torch.equal(generate_ids(served, prompt, 6), want)
    assert CountingRows.gathered > 0  # the rows came through the new backend


def test_a_new_tier_trains_through_the_loop(monkeypatch, tmp_path):
    from stemlm.train import Trainer
    from train_helpers import debug_config, losses, make_token_data

    monkeypatch.setitem(tiers_mod.TIER_CLASSES, CountingTier.name, CountingTier)  # its line in the registry
    data = make_token_data(tmp_path / "data")
    common = ("model.ffn=stem", "model.stem_layers=1/2", "run.steps=3")
    with Trainer(debug_config(data, tmp_path / "device", *common)) as t:
        t.fit()
    CountingRows.gathered = 0
    with Trainer(debug_config(data, tmp_path / "counting", *common, "run.tables=counting")) as t:
        assert t.model.tables.tier == "counting" and t.table_path == "reference"
        t.fit()
    assert CountingRows.gathered > 0  # every step's rows came through the new backend
    assert losses(tmp_path / "counting") == losses(tmp_path / "device")
    assert generate_ids(open_model(tmp_path / "counting"), torch.tensor([[3, 4]]), 3).shape == (1, 5)
