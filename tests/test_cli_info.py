"""`stemlm info` and `stemlm plan` through the real CLI entry point."""

import json

import pytest

from stemlm import StemLM, model_config
from stemlm import accounting as acc
from stemlm.checkpoint.directory import save_model
from stemlm.cli import main


def _run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_info_json_has_the_documented_keys(capsys):
    code, out, _ = _run(capsys, "info", "--json", "--ffn", "stem", "--stem-layers", "1/2", "model.vocab_size=1024")
    assert code == 0
    r = json.loads(out)
    cfg = model_config("debug", ffn="stem", stem_layers="1/2", vocab_size=1024)
    for key in ("total_params", "active_params", "flops_per_token_forward", "flops_per_token_train",
                "decode_param_bytes", "stem_layers", "saving_fraction_per_stem_layer"):
        assert key in r
    assert r["total_params"] == StemLM(cfg).num_parameters()
    assert r["stem_layers"] == list(cfg.stem_layer_ids) and r["config"]["vocab_size"] == 1024
    assert r["flops_per_token_forward"] == acc.forward_flops_per_token(cfg, cfg.max_seq_len)


def test_info_table_lists_layers_and_ratios(capsys):
    code, out, _ = _run(capsys, "info", "--preset", "llama3.2-1b", "--seq-len", "4096")
    assert code == 0
    assert "layers 2,5,8,11,14 (5 of 16)" in out
    assert "6.67B" in out and "1.41B" in out and "Hash-MoE match: 22 experts" in out
    kinds = [line.split()[1] for line in out.splitlines() if line.split()[:1] and line.split()[0].isdigit()]
    assert kinds == ["stem" if i in (2, 5, 8, 11, 14) else "dense" for i in range(16)]


@pytest.mark.parametrize("argv, message", [
    (["train.lr=1"], "only model.FIELD=VALUE"),
    (["model.d_model=3"], "does not divide"),
    (["--stem-layers", "9"], "out of range"),
    (["--preset", "debug", "--ckpt", "x"], "--ckpt"),
])
def test_info_bad_input_is_one_clear_line(capsys, argv, message):
    code, _, err = _run(capsys, "info", *argv)
    assert code == 2 and message in err and err.count("\n") == 1


def test_info_describes_a_checkpoint(capsys, tmp_path):
    cfg = model_config("debug", ffn="stem_dagger", stem_layers="1/2", tie_embeddings=True)
    save_model(StemLM(cfg), tmp_path / "ckpt")
    code, out, _ = _run(capsys, "info", "--ckpt", str(tmp_path / "ckpt"), "--json")
    r = json.loads(out)
    assert code == 0 and r["config"]["ffn"] == "stem_dagger" and r["config"]["tie_embeddings"]
    assert r["checkpoint"]["stored_params"] == r["total_params"] == StemLM(cfg).num_parameters()
    code, out, _ = _run(capsys, "info", "--ckpt", str(tmp_path / "ckpt"))
    assert code == 0 and "matches the count above" in out


def test_plan_text_and_json(capsys):
    code, out, _ = _run(capsys, "plan", "--preset", "7b-class", "--cache-frac", "0.05", "--batch", "2", "--seq", "1024")
    assert code == 0 and "accelerator memory" in out and "decode:" in out and "prefill:" in out
    code, out, _ = _run(capsys, "plan", "--tables", "disk", "--train", "--json")
    r = json.loads(out)
    assert code == 0 and r["train"] and set(r["steps"]) == {"train"} and r["disk_bytes"]["tables_and_state"] > 0
    code, _, err = _run(capsys, "plan", "--cache-frac", "2")
    assert code == 2 and "--cache-frac" in err and err.count("\n") == 1
