"""``run.table_path`` and ``run.tables`` in the training loop: the fused path, host-RAM tables and the
serving tiers' ``TableStore`` (host, disk) give the reference run's losses and checkpoints (bit for bit
on the CPU), checkpoints resume across paths and tiers, and bad settings fail with one-line errors."""

import pytest
import torch

from stemlm.config import ConfigError
from stemlm.store import TableStore
from stemlm.train.fused import FusedTables, HostTables, SlabTables
from stemlm.train import Trainer
from stemlm.train.state import load_optimizer_state  # noqa: F401  (the format both paths share)
from train_helpers import debug_config, losses, make_token_data, one_thread  # noqa: F401

COMMON = ("run.steps=6", "optim.grad_accum=2", "optim.grad_clip=0.5", "optim.decay_untouched=catchup",
          "optim.table_weight_decay=0.1", "model.ffn=stem", "model.stem_layers=1/2", "run.ckpt_every=3",
          "run.eval_every=3")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_token_data(tmp_path_factory.mktemp("tp") / "data")


def _run(data, out, *overrides):
    with Trainer(debug_config(data, out, *COMMON, *overrides)) as t:
        result = t.fit()
        return t, result


def test_fused_and_host_runs_equal_the_reference(data, tmp_path):
    ref, ref_result = _run(data, tmp_path / "ref", "run.table_path=reference")
    assert type(ref.model.tables).__name__ == "Tables"
    for name, extra, kind in (("fused", ("run.table_path=fused",), FusedTables),
                              ("host", ("run.tables=host",), HostTables),
                              ("host_cache", ("run.tables=host", "run.table_cache_rows=20"), HostTables),
                              ("host_store", ("run.tables=host", "run.table_path=reference"), TableStore),
                              ("disk_store", ("run.tables=disk",), TableStore)):
        t, result = _run(data, tmp_path / name, *extra)
        assert isinstance(t.model.tables, kind)
        assert losses(tmp_path / name) == losses(tmp_path / "ref")
        assert result.val_loss == ref_result.val_loss
        got, want = t.model.state_dict(), ref.model.state_dict()
        for k in want:
            assert torch.equal(got[k].cpu(), want[k].cpu()), k
        for k, v in ref.table_opt.state_dict()[0].items():
            assert torch.equal(t.table_opt.state_dict()[0][k].cpu(), v.cpu()), k
        if kind is TableStore:  # the tier the serving side uses, trained through the table protocol
            assert t.model.tables.tier == extra[0].split("=")[1] and t.model.tables.stats()["rows_written"] > 0
    assert (tmp_path / "disk_store" / "tables.safetensors").is_file()  # the disk tier's rows, in the run dir


@pytest.fixture(scope="module")
def wide_data(tmp_path_factory):  # 400 ids in use: a step meets ~190 of them, a slab of 240 must evict
    return make_token_data(tmp_path_factory.mktemp("tp") / "wide", used=400)


@pytest.mark.parametrize("slab", [0, 240])
def test_host_tables_through_a_fixed_slab_equal_the_device_tables(wide_data, tmp_path, slab):
    """``run.tables=host`` with ``run.step_graph=static`` (the step a CUDA graph captures) trains through a fixed
    device slab (``SlabTables``): the losses, weights and optimizer state of the same fixed-buffer step with the
    tables on the device, bit for bit, with the default slab (the keys of two steps) and one so small that most
    steps evict rows and load them back; a checkpoint written from it resumes on the device tables."""
    fixed = ("run.table_path=fused", "run.step_graph=static")
    ref, ref_result = _run(wide_data, tmp_path / "device", *fixed)
    assert isinstance(ref.model.tables, FusedTables)
    extra = ("run.tables=host", *fixed) + ((f"run.table_slab_rows={slab}",) if slab else ())
    t, result = _run(wide_data, tmp_path / "slab", *extra)
    tables = t.model.tables
    assert isinstance(tables, SlabTables) and t.captured is not None
    assert tables.capacity == (slab or 2 * 2 * 4 * 32)  # the keys of two steps: debug's 4 × 32 tokens, accum 2
    if slab:
        assert tables.traffic["rows_out"] > 0 and tables.traffic["rows_in"] > tables.capacity  # rows came back
    assert losses(tmp_path / "slab") == losses(tmp_path / "device") and result.val_loss == ref_result.val_loss
    got, want = t.model.state_dict(), ref.model.state_dict()
    for k in want:
        assert torch.equal(got[k].cpu(), want[k].cpu()), k
    for k, v in ref.table_opt.state_dict()[0].items():
        assert torch.equal(t.table_opt.state_dict()[0][k].cpu(), v.cpu()), k
    with Trainer(debug_config(wide_data, tmp_path / "split", *COMMON, *extra)) as t:
        t.fit(stop_at=3)
    with Trainer(debug_config(wide_data, tmp_path / "split", *COMMON, *fixed), resume=True) as t:
        t.fit()
    assert losses(tmp_path / "split") == losses(tmp_path / "device")


def test_a_slab_too_small_for_a_step_is_one_line(data, tmp_path):
    with pytest.raises(ValueError, match=r"a step uses \d+ distinct table rows .* but the device slab has 4 slots"):
        _run(data, tmp_path / "tiny", "run.tables=host", "run.step_graph=static", "run.table_slab_rows=4")


@pytest.mark.parametrize("first, then", [
    ("run.tables=host", "run.table_path=reference"),  # host-RAM training tables, resumed on the device
    ("run.tables=disk", "run.tables=disk"),  # the disk tier's TableStore, resumed on it
])
def test_checkpoints_resume_across_paths_and_tiers(data, tmp_path, first, then):
    _run(data, tmp_path / "whole", "run.table_path=reference")
    with Trainer(debug_config(data, tmp_path / "split", *COMMON, first)) as t:
        t.fit(stop_at=3)
    with Trainer(debug_config(data, tmp_path / "split", *COMMON, then), resume=True) as t:
        t.fit()
    assert losses(tmp_path / "split")[3:] == losses(tmp_path / "whole")[3:]


@pytest.mark.parametrize("overrides, message", [
    (("run.table_path=fast",), "run.table_path: 'fast' is not one of auto, fused, reference"),
    (("run.tables=tape",), "run.tables: 'tape' is not one of device, host, disk"),
    (("run.table_cache_rows=8",), "run.table_cache_rows keeps host-RAM rows on the accelerator: it needs run.tables=host"),
    (("run.table_kernels=cuda",), "run.table_kernels: 'cuda' is not one of auto, triton, triton-gemm, torch"),
    (("run.tables=disk", "run.table_path=fused"), "run.tables=disk trains through the reference table path"),
    (("run.tables=host", "optim.table_optimizer=dense"), "run.tables=host: tables off the device train with the row-sparse"),
    (("run.table_path=fused", "optim.table_optimizer=dense"), "run.table_path=fused needs optim.table_optimizer=sparse"),
])
def test_bad_settings_fail_clearly(data, tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        Trainer(debug_config(data, tmp_path / "bad", *COMMON, *overrides))


def test_auto_is_reference_on_cpu(data, tmp_path):
    with Trainer(debug_config(data, tmp_path / "auto", *COMMON)) as t:
        assert t.table_path == "reference"


def test_hot_ids_are_the_most_frequent():
    from stemlm.train.fused.apply import hot_ids

    tokens = [5, 5, 5, 2, 2, 9, 9, 1]
    assert hot_ids(tokens, 12, 2).tolist() == [2, 5]
    assert hot_ids(tokens, 12, 3).tolist() == [2, 5, 9]  # 2 and 9 tie: the smaller id first, then 9 beats 1
    assert hot_ids(tokens, 12, 100).tolist() == list(range(12))
