"""Offload planner: the Zipf unique-row estimate against sampling, monotonicity, byte formulas."""

import numpy as np
import pytest

from stemlm import ConfigError, model_config
from stemlm import accounting as acc
from stemlm.ffn.hash_moe import expected_experts_touched
from stemlm.planner import EXTRA_SHAPES, Hardware, plan, resolve_model_config


def _sampled_distinct(n, vocab, s, skip_top=0, trials=200, seed=0):
    """Monte Carlo: mean number of distinct ranks > skip_top among n Zipf draws."""
    rng = np.random.default_rng(seed)
    p = acc.zipf_probabilities(vocab, s)
    draws = rng.choice(vocab, size=(trials, n), p=p)  # 0-based ranks, most frequent first
    return np.mean([len(np.unique(row[row >= skip_top])) for row in draws])


@pytest.mark.parametrize("n, vocab, s, skip_top", [(64, 1000, 1.0, 0), (2000, 1000, 1.0, 0), (500, 5000, 1.1, 0),
                                                    (2000, 5000, 1.0, 50), (300, 1000, 0.0, 0)])
def test_unique_rows_estimate_matches_sampling(n, vocab, s, skip_top):
    est = acc.unique_rows_estimate(n, vocab, s, skip_top=skip_top)
    assert est == pytest.approx(_sampled_distinct(n, vocab, s, skip_top), rel=0.03)


def test_unique_rows_estimate_limits_and_monotonicity():
    vocab = 4096
    assert acc.unique_rows_estimate(0, vocab) == 0
    assert acc.unique_rows_estimate(1, vocab) == pytest.approx(1)
    assert acc.unique_rows_estimate(300, vocab, 0.0) == pytest.approx(vocab * (1 - (1 - 1 / vocab) ** 300))
    counts = [acc.unique_rows_estimate(n, vocab) for n in (1, 10, 100, 1000, 10**5, 10**9)]
    assert all(a < b for a, b in zip(counts, counts[1:]))
    assert all(c <= min(n, vocab) + 1e-9 for c, n in zip(counts, (1, 10, 100, 1000, 10**5, 10**9)))
    assert counts[-1] == pytest.approx(vocab, rel=1e-3)
    misses = [acc.unique_rows_estimate(1000, vocab, skip_top=k) for k in (0, 10, 100, 1000, vocab)]
    assert all(a > b for a, b in zip(misses, misses[1:])) and misses[-1] == 0
    with pytest.raises(ValueError):
        acc.unique_rows_estimate(10, vocab, skip_top=vocab + 1)


def test_step_bytes_and_memory_formulas():
    cfg = resolve_model_config("7b-class", "stem", "1/3")
    p = plan(cfg, tables="host", cache_frac=0.05, batch=4, seq_len=2048, dtype_bytes=2)
    n_t, row = len(cfg.table_layers), cfg.d_ff * 2
    assert n_t == 10 and p["cache_rows"] == round(0.05 * cfg.vocab_size)
    for name, tokens in (("prefill", 4 * 2048), ("decode", 4)):
        s = p["steps"][name]
        assert s["tokens"] == tokens
        assert s["rows_to_move_per_layer"] == pytest.approx(
            acc.unique_rows_estimate(tokens, cfg.vocab_size, skip_top=p["cache_rows"]))
        assert s["cache_hits_per_layer"] + s["rows_to_move_per_layer"] == pytest.approx(s["unique_rows_per_layer"])
        assert s["bytes_to_move"] == pytest.approx(n_t * s["rows_to_move_per_layer"] * row)
        assert s["transfer_s"] == pytest.approx(s["bytes_to_move"] / 25e9)
    parts = acc.param_breakdown(cfg)
    mem = p["accelerator_bytes"]
    assert mem["backbone_weights"] == 2 * (acc.total_params(cfg) - parts["tables"])
    assert mem["row_cache"] == n_t * p["cache_rows"] * row
    assert mem["kv_cache"] == acc.kv_cache_bytes(cfg, 4, 2048, 2)
    assert p["host_bytes"]["tables_and_state"] == 2 * parts["tables"]
    assert p["steps"]["prefill"]["flops"] == pytest.approx(4 * 2048 * acc.forward_flops_per_token(cfg, 2048, causal=True))


def test_plan_monotone_in_cache_link_and_batch():
    cfg = model_config("llama3.2-1b", ffn="stem")
    moved = [plan(cfg, cache_frac=f, batch=8, seq_len=1024)["steps"]["prefill"]["bytes_to_move"] for f in (0, 0.01, 0.1, 1)]
    assert all(a > b for a, b in zip(moved, moved[1:])) and moved[-1] == 0
    times = [plan(cfg, batch=8, seq_len=1024, hardware=Hardware(link_gbps=g))["steps"]["prefill"]["transfer_s"]
             for g in (1, 10, 100)]
    assert times[0] > times[1] > times[2]
    rows = [plan(cfg, batch=b, seq_len=1024)["steps"]["decode"]["rows_to_move"] for b in (1, 8, 64)]
    assert rows[0] < rows[1] < rows[2]
    slow = plan(cfg, batch=64, seq_len=2048, hardware=Hardware(link_gbps=0.01))["steps"]["prefill"]
    assert not slow["transfer_hidden"]


def test_training_disk_and_device_tiers():
    cfg = model_config("llama3.2-1b", ffn="stem")
    tables = acc.param_breakdown(cfg)["tables"]
    train = plan(cfg, tables="disk", train=True, batch=2, seq_len=512, optimizer_bytes=8)
    assert set(train["steps"]) == {"train"} and "kv_cache" not in train["accelerator_bytes"]
    assert train["disk_bytes"]["tables_and_state"] == tables * (2 + 8) and train["host_bytes"]["tables_and_state"] == 0
    s = train["steps"]["train"]
    assert s["bytes_back"] == s["bytes_to_move"]
    assert s["disk_bytes"] == pytest.approx(2 * s["rows_to_move"] * cfg.d_ff * (2 + 8))
    assert s["flops"] == pytest.approx(3 * 2 * 512 * acc.forward_flops_per_token(cfg, 512, causal=True))
    device = plan(cfg, tables="device", batch=2, seq_len=512)
    assert device["steps"]["decode"]["bytes_to_move"] == 0 and device["accelerator_bytes"]["row_cache"] == 2 * tables
    dense = plan(model_config("llama3.2-1b", ffn="dense"), batch=2, seq_len=512)
    assert dense["steps"]["prefill"]["rows_to_move"] == 0 and dense["steps"]["decode"]["transfer_hidden"]


def test_config_resolution_and_errors():
    assert resolve_model_config("7b-class", "dense").d_model == EXTRA_SHAPES["7b-class"]["d_model"]
    assert resolve_model_config("debug", "stem", "1/2", ["model.vocab_size=1024"]).vocab_size == 1024
    with pytest.raises(ConfigError, match="preset"):
        resolve_model_config("nope")
    with pytest.raises(ConfigError, match="model.FIELD"):
        resolve_model_config("debug", overrides=["train.lr=1"])
    cfg = model_config("debug")
    for bad in (dict(tables="gpu"), dict(cache_frac=1.5), dict(batch=0)):
        with pytest.raises(ValueError):
            plan(cfg, **bad)
    with pytest.raises(ValueError):
        Hardware(link_gbps=0)
    assert expected_experts_touched(8, 1) == pytest.approx(1)
    assert expected_experts_touched(8, 10**6) == pytest.approx(8)


def test_quantized_tables_store_and_move_fewer_bytes():
    from stemlm.model.quant import RowCodec

    cfg = model_config("tiny", ffn="stem", stem_layers="1/3")
    plain = plan(cfg, tables="disk", dtype_bytes=4)
    for name in ("bf16", "int8", "int4"):
        q = plan(cfg, tables="disk", dtype_bytes=4, table_dtype=name)
        row = RowCodec(name).row_bytes(cfg.d_ff)
        assert q["row_bytes"] == row and q["disk_bytes"]["tables_and_state"] == len(cfg.table_layers) * cfg.vocab_size * row
        assert q["steps"]["decode"]["bytes_to_move"] == pytest.approx(plain["steps"]["decode"]["bytes_to_move"] * row / (4 * cfg.d_ff))
    with pytest.raises(ValueError, match="int8 tables are for inference"):
        plan(cfg, train=True, table_dtype="int8")


def test_train_plan_shows_memory_with_and_without_host_tables():
    from stemlm.planner import plan, resolve_model_config, train_window_bytes

    cfg = resolve_model_config("7b-class", "stem", "1/3")
    p = plan(cfg, tables="host", batch=4, seq_len=2048, train=True, dtype_bytes=4)
    window = train_window_bytes(cfg, 4 * 2048, 4, 8, 1.0)
    assert p["accelerator_bytes"]["step_window"] == window
    mem = p["train_memory"]
    assert mem["host"] - window == mem["device"] - len(cfg.table_layers) * cfg.vocab_size * cfg.d_ff * 12
    assert mem["host"] < mem["device"]  # 128k-row tables: two steps' rows are a small part of them
    assert plan(cfg, tables="host", batch=1, seq_len=64)["train_memory"] is None  # inference plans have none


def test_train_bus_bytes_counts_rows_consecutive_steps_do_not_share():
    from stemlm.planner import train_bus_bytes

    cfg = resolve_model_config("tiny", ffn="stem", stem_layers="full")
    per_row = len(cfg.table_layers) * cfg.d_ff * 12
    few = train_bus_bytes(cfg, 4, 4, 8, 1.0)
    assert 0 < few <= 2 * 4 * per_row  # at most every row of the step in and as many out
    # a step that touches every row shares every row with the next: nothing crosses the bus
    assert train_bus_bytes(cfg, 10**9, 4, 8, 1.0) < 1e-6 * per_row
