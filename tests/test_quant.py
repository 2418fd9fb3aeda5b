"""Quantized tables (bf16, int8, int4): codec error and exactness, every tier equal, checkpoints, edits, CLI."""

import json
import subprocess
import sys

import pytest
import torch

from stemlm import StemLM, model_config
from stemlm.checkpoint.directory import WEIGHTS_FILE, save_model
from stemlm.store import open_model
from stemlm.edit import swap
from stemlm.model.quant import QuantizedTable, RowCodec, codec_of, quantize_tables
from stemlm.checkpoint.safetensors_io import read_header
from stemlm.store import Placement, export_tables, offload_tables, open_model

QUANT = ["bf16", "int8", "int4"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    torch.manual_seed(0)
    cfg = model_config("debug", ffn="stem", stem_layers="1/2")  # tables on layers 1 and 3
    model = StemLM(cfg).eval()
    root = tmp_path_factory.mktemp("quant")
    save_model(model, root / "fp32")
    ids = torch.randint(0, cfg.vocab_size, (2, 13))
    return cfg, model, root, ids


def _codes(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items() if k.startswith("tables.")}


@pytest.mark.parametrize("name", [*QUANT, "int8-per-row"])
def test_encode_decode_is_a_fixpoint_and_errors_are_small(name):
    rows = torch.randn(300, 70) * torch.rand(300, 1) * 5  # 70: not a multiple of the int4 / int8 group
    rows[7] = 0
    codec = RowCodec("int8", 0) if name == "int8-per-row" else RowCodec(name)
    name = codec.name
    codes, scale = codec.encode(rows)
    back = codec.decode(codes, scale, 70)
    codes2, scale2 = codec.encode(back)
    assert torch.equal(codes, codes2) and (scale is None or torch.equal(scale, scale2))
    assert torch.equal(codec.decode(codes2, scale2, 70), back)
    assert torch.equal(back[7], torch.zeros(70))
    rel = ((back - rows).norm() / rows.norm()).item()
    assert rel < {"bf16": 0.005, "int8": 0.01, "int4": 0.15}[name]
    per_value = (back - rows).abs().max(dim=1).values / rows.abs().max(dim=1).values.clamp_min(1e-12)
    if name == "int8":  # absmax: at most half a step of absmax / 127 off
        assert per_value.max() <= 0.5 / 127 + 1e-6
    want = {"bf16": 140, "int8": 74 if not codec.grouped else 128 + 4 * 2,  # 2 groups of 64, the last one padded
            "int4": 96 // 2 + 4 * 3}[name]  # 3 groups of 32, the last one padded
    assert codec.row_bytes(70) == want


def test_int8_groups_keep_an_outlier_column_from_setting_every_step():
    """One column far above the rest (as in SmolLM2's calibrated tables): one scale per row rounds the other
    columns to a few levels; groups of 64 confine the outlier to its own group. Files written with one scale per
    row (no group size in their metadata) still decode as such."""
    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(200, 256, generator=gen)
    rows[:, 17] = 30.0  # ~30x the rows' RMS, in every row
    errs = {}
    for codec in (RowCodec("int8"), RowCodec("int8", 0)):
        codes, scale = codec.encode(rows)
        others = torch.ones(256, dtype=torch.bool)
        others[:64] = False  # columns outside the outlier's group
        errs[codec.grouped] = float((codec.decode(codes, scale, 256) - rows)[:, others].abs().max())
    assert errs[True] < 0.02 and errs[False] > 0.1  # 0.5 step of |x|max/127 in each group vs 30/254 everywhere
    assert RowCodec("int8").group_size == 64 and RowCodec("int4").group_size == 32
    assert RowCodec.from_metadata({"stemlm_table_dtype": "int8"}) == RowCodec("int8", 0)  # before groups
    assert RowCodec.from_metadata(RowCodec("int8").metadata()) == RowCodec("int8")
    assert RowCodec("int8", 0).label == "int8 (one scale per row)" and RowCodec("int8").label == "int8"
    with pytest.raises(ValueError, match="int8 group size"):
        RowCodec("int8", -1)


def test_bad_codecs_and_rows_are_refused():
    with pytest.raises(ValueError, match="unknown table dtype 'int3'"):
        RowCodec("int3")
    with pytest.raises(ValueError, match="NaN/inf"):
        RowCodec("int8").encode(torch.tensor([[1.0, float("nan")]]))
    with pytest.raises(ValueError, match="for inference"):
        QuantizedTable(4, 3, RowCodec("int8")).sparse_grad = True


@pytest.mark.parametrize("name", QUANT)
def test_quantized_model_on_every_tier_equals_device_and_reloads_exactly(setup, name, tmp_path):
    cfg, model, root, ids = setup
    fp32 = open_model(root / "fp32")
    quantize_tables(fp32, name)
    assert codec_of(fp32.tables).name == name
    with torch.no_grad():
        want, ref = fp32(ids), model(ids)
    assert (want - ref).abs().max() < {"bf16": 1e-3, "int8": 3e-3, "int4": 5e-2}[name]
    save_model(fp32, tmp_path / name)
    assert torch.equal(open_model(tmp_path / name)(ids), want)
    for tier, cache in [("device", 0), ("host", 0), ("host", 5), ("disk", 0), ("disk", 5)]:
        loaded = open_model(tmp_path / name, Placement(tier, cache_rows=cache))
        store = loaded.tables
        with torch.no_grad():
            assert torch.equal(loaded(ids, table_rows=store.prefetch(ids)), want), (tier, cache)
        if tier != "device":  # traffic counts the stored bytes of a row
            stats = store.stats()
            assert stats["bytes_moved"] == stats["rows_moved"] * RowCodec(name).row_bytes(cfg.d_ff)
        store.close()
    for tier in ("device", "host"):  # re-encoded at load from the fp32 checkpoint: the same model
        loaded = open_model(root / "fp32", Placement(tier, table_dtype=name))
        store = loaded.tables
        assert torch.equal(loaded(ids), want), tier


def test_stored_bytes_shrink_by_the_codec(setup, tmp_path):
    cfg, model, root, _ = setup
    table_bytes = {}
    for name in ["fp32"] + QUANT:
        path = export_tables(root / "fp32", tmp_path / f"{name}.safetensors", table_dtype=name)
        table_bytes[name] = sum(i.nbytes for i in read_header(path).values())
        assert table_bytes[name] == len(cfg.table_layers) * cfg.vocab_size * RowCodec(name).row_bytes(cfg.d_ff)
    assert table_bytes["fp32"] / table_bytes["bf16"] == 2
    assert table_bytes["fp32"] / table_bytes["int8"] > 3.5  # d_ff + 4 bytes a row instead of 4 d_ff
    assert table_bytes["fp32"] / table_bytes["int4"] > 5.5


def test_disk_tier_serves_as_stored_and_names_the_conversion(setup, tmp_path):
    _, _, root, ids = setup
    with pytest.raises(ValueError, match="stemlm convert --ckpt .* --table-dtype int8"):
        open_model(root / "fp32", Placement("disk", table_dtype="int8"))
    tables = export_tables(root / "fp32", tmp_path / "t.safetensors", table_dtype="int8")
    served = open_model(root / "fp32", Placement("disk", tables_file=tables))
    store = served.tables
    device = open_model(root / "fp32", Placement("device", table_dtype="int8"))
    assert torch.equal(served(ids), device(ids))
    store.close()


@pytest.mark.parametrize("tier", ["device", "host", "disk"])
def test_offload_a_model_with_a_table_dtype(setup, tier, tmp_path):
    _, model, root, ids = setup
    want = open_model(root / "fp32")
    quantize_tables(want, "int8")
    moved = open_model(root / "fp32")
    tables_file = tmp_path / "t.safetensors" if tier == "disk" else None
    store = offload_tables(moved, Placement(tier, tables_file=tables_file, table_dtype="int8"))
    assert torch.equal(moved(ids), want(ids))
    store.close()


@pytest.mark.parametrize("name", ["int8", "int4"])
@pytest.mark.parametrize("tier", ["device", "disk"])
def test_swap_on_quantized_rows_moves_codes_exactly_and_undo_restores_them(setup, name, tier, tmp_path):
    _, _, root, ids = setup
    model = open_model(root / "fp32")
    quantize_tables(model, name)
    save_model(model, tmp_path / name)
    weights = (tmp_path / name / WEIGHTS_FILE).read_bytes()
    model = open_model(tmp_path / name, Placement(tier, writable=True))
    store = model.tables
    before, logits = _codes(model), model(ids)
    record = swap(model, [11], [12])
    after = _codes(model)
    for key, codes in before.items():  # rows 11 and 12 exchanged bit for bit, codes and scales alike
        assert torch.equal(after[key][11], codes[12]) and torch.equal(after[key][12], codes[11])
        assert torch.equal(torch.cat([after[key][:11], after[key][13:]]), torch.cat([codes[:11], codes[13:]]))
    record.undo()
    assert all(torch.equal(_codes(model)[k], v) for k, v in before.items())
    assert torch.equal(model(ids), logits)
    store.close()
    assert (tmp_path / name / WEIGHTS_FILE).read_bytes() == weights  # the checkpoint never changes


def test_transformers_and_training_refuse_quantized_tables(setup, tmp_path):
    _, _, root, _ = setup
    model = open_model(root / "fp32")
    quantize_tables(model, "int8")
    save_model(model, tmp_path / "int8")
    import stemlm.interop.hf  # noqa: F401
    from transformers import AutoModelForCausalLM

    with pytest.raises(ValueError, match="stores its STEM tables as int8.*--table-dtype fp32"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "int8")
    with pytest.raises(ValueError, match="int8 tables are for inference"):
        for table in model.tables.values():
            table.sparse_grad = True
    from stemlm.config import ConfigError
    from stemlm.train import load_train_config
    from stemlm.train.build import build_model

    cfg = load_train_config("debug", None, ["run.stage=midtrain", f"run.init_from={tmp_path / 'int8'}"])
    with pytest.raises(ConfigError, match="stores its tables as int8, which cannot be trained.*--table-dtype fp32"):
        build_model(cfg, 512)


def _cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "stemlm", *args], capture_output=True, text=True, cwd=cwd)


def test_convert_table_dtype_cli_round_trip_and_errors(setup, tmp_path):
    _, _, root, ids = setup
    out = _cli("convert", "--ckpt", str(root / "fp32"), "--table-dtype", "int8", "--out", str(tmp_path / "int8"))
    assert out.returncode == 0, out.stderr
    assert "tables stored as int8" in out.stdout
    expect = open_model(root / "fp32")
    quantize_tables(expect, "int8")
    assert torch.equal(open_model(tmp_path / "int8")(ids), expect(ids))
    back = _cli("convert", "--ckpt", str(tmp_path / "int8"), "--table-dtype", "fp32", "--out", str(tmp_path / "back"))
    assert back.returncode == 0, back.stderr
    assert codec_of(open_model(tmp_path / "back").tables).name == "fp32"
    assert json.loads((tmp_path / "back" / "config.json").read_text())["model_type"] == "stemlm"
    for args, message in [
        (["convert", "--ckpt", str(root / "fp32"), "--out", str(tmp_path / "x")], "--ckpt alone needs --table-dtype"),
        (["convert", "--ckpt", str(root / "fp32"), "--table-dtype", "int9", "--out", str(tmp_path / "x")],
         "invalid choice: 'int9'"),
        (["convert", "--to-hf", "--ckpt", str(root / "fp32"), "--table-dtype", "int8", "--out", str(tmp_path / "x")],
         "--table-dtype does not apply to --to-hf"),
    ]:
        res = _cli(*args)
        assert res.returncode == 2 and message in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert not (tmp_path / "x").exists()
