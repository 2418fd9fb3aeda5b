"""Accounting against real modules (parameters, FLOPs, decode bytes) and against the paper's numbers."""

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

from stemlm import StemLM, model_config
from stemlm import accounting as acc
from kv_helpers import KVCache

KINDS = ["dense", "stem", "stem_dagger", "stem_gate", "hash_moe"]
# On CPU, torch 2.13 runs SDPA through this kernel, which FlopCounterMode has no formula for
# (it counts 0); this mapping gives it torch's own SDPA formula (full L × L, causality ignored).
CPU_SDPA = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu:
            lambda q, k, v, *args, out_shape=None, **kwargs: sdpa_flop_count(q, k, v)}


def _count(fn, custom_mapping=None) -> int:
    with FlopCounterMode(display=False, custom_mapping=custom_mapping) as counter:
        fn()
    return counter.get_total_flops()


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("kind", KINDS)
def test_total_params_equal_the_module(kind, tied):
    cfg = model_config("debug", ffn=kind, stem_layers="1/2", tie_embeddings=tied)
    assert acc.total_params(cfg) == StemLM(cfg).num_parameters()


@pytest.mark.parametrize("kind", KINDS)
def test_active_params_and_decode_bytes_equal_touched_parameters(kind):
    """Independent count from the module's named parameters: what one token reads."""
    cfg = model_config("debug", ffn=kind, stem_layers="1/2")
    touched = 0
    for name, p in StemLM(cfg).named_parameters():
        if name.startswith("tables."):
            touched += p.shape[1]  # one row
        elif name == "tok_embeddings.weight":
            touched += p.shape[1]
        elif ".ffn.w_" in name and p.dim() == 3:
            touched += p[0].numel()  # one expert
        else:
            touched += p.numel()
    assert acc.active_params(cfg, embedding="row") == touched
    assert acc.decode_param_bytes(cfg, dtype_bytes=2) == 2 * touched
    assert acc.active_params(cfg) == touched - cfg.d_model + cfg.vocab_size * cfg.d_model


@pytest.mark.parametrize("kind", KINDS)
def test_forward_flops_match_flop_counter(kind):
    cfg = model_config("debug", ffn=kind, stem_layers="1/2")
    model, seq = StemLM(cfg).eval(), 16
    ids = torch.randint(0, cfg.vocab_size, (1, seq))
    fwd = acc.forward_flops_per_token(cfg, seq)
    scores = sum(r["attn_scores"] for r in acc.forward_flops_per_layer(cfg, seq))
    with torch.no_grad():
        # the CPU SDPA kernel is invisible to FlopCounterMode: everything else is counted exactly
        assert _count(lambda: model(ids)) == seq * (fwd - scores)
        # with a formula for it, or on the math backend (explicit bmm), the full-L convention is exact
        assert _count(lambda: model(ids), CPU_SDPA) == seq * fwd
        with sdpa_kernel(SDPBackend.MATH):
            assert _count(lambda: model(ids)) == seq * fwd


def test_causal_average_is_the_mean_of_decode_costs():
    """Decoding the token at position p costs the full-L count at L = p; a causal sequence averages them."""
    cfg = model_config("debug", ffn="stem")
    model, seq = StemLM(cfg).eval(), 12
    ids = torch.randint(0, cfg.vocab_size, (1, seq))
    cache = KVCache(cfg, 1, seq)
    costs = []
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
        for p in range(seq):
            costs.append(_count(lambda: model(ids[:, p:p + 1], start_pos=p, cache=cache)))
            assert costs[-1] == acc.forward_flops_per_token(cfg, p + 1)
    assert sum(costs) / seq == acc.forward_flops_per_token(cfg, seq, causal=True)


@pytest.mark.parametrize("kind", ["dense", "stem", "hash_moe"])
def test_training_flops_are_three_times_forward(kind):
    cfg = model_config("debug", ffn=kind, stem_layers="1/2")
    model, seq = StemLM(cfg), 8
    ids = torch.randint(0, cfg.vocab_size, (1, seq))
    with sdpa_kernel(SDPBackend.MATH):
        total = _count(lambda: model(ids).square().mean().backward())
    assert total == seq * acc.train_flops_per_token(cfg, seq)


def test_per_layer_flops_and_stem_saving():
    cfg = model_config("llama3.2-1b", ffn="stem", stem_layers="1/3")
    layers = acc.forward_flops_per_layer(cfg, 4096)
    dense, stem = layers[0], layers[2]
    assert stem["kind"] == "stem" and dense["kind"] == "dense"
    assert dense["total"] - stem["total"] == 2 * cfg.d_model * cfg.d_ff  # d·d_ff MACs saved
    assert acc.layer_saving_fraction(cfg, 4096) == pytest.approx(1 - stem["total"] / dense["total"])
    assert acc.layer_saving_fraction(cfg, 4096, "stem_dagger") == 0
    # with MHA projections the exact fraction is the paper's formula
    mha = cfg.replace(n_kv_heads=cfg.n_heads)
    assert acc.layer_saving_fraction(mha, 4096) == pytest.approx(acc.saving_fraction(2048, 8192, 4096))


@pytest.mark.parametrize("d, d_ff, paper, formula", [
    (1536, 8960, 21.7, 21.7),
    (2048, 11008, 22.8, 22.3),  # the paper prints 22.8; 11008 / 49408 = 0.2228
    (3584, 18944, 23.9, 23.9),
    (5120, 13824, 19.7, 19.7),
    (5120, 27648, 24.8, 24.8),
])
def test_qwen25_saving_fractions(d, d_ff, paper, formula):
    assert round(100 * acc.saving_fraction(d, d_ff, 4096), 1) == formula
    assert abs(formula - paper) <= 0.5


def test_table3_llama32_1b_rows():
    dense = model_config("llama3.2-1b", ffn="dense")
    stem = model_config("llama3.2-1b", ffn="stem", stem_layers="1/3")
    assert stem.stem_layer_ids == (2, 5, 8, 11, 14)
    assert round(acc.total_params(dense) / 1e9, 2) == 1.50
    assert round(acc.active_params(stem) / 1e9, 2) == 1.41  # input embedding counted whole
    assert round(acc.active_params(stem, embedding="row") / 1e9, 2) == 1.15
    up_proj, table = dense.d_model * dense.d_ff, dense.vocab_size * dense.d_ff
    assert acc.total_params(stem) == acc.total_params(dense) + 5 * (table - up_proj)
    assert round(acc.total_params(stem) / 1e9, 2) == 6.67
    # the paper's 6.75B is the dense model plus five tables with W_u kept
    assert round((acc.total_params(dense) + 5 * table) / 1e9, 2) == 6.75


def test_hash_moe_matches_stem_parameters():
    for preset in ("debug", "llama3.2-1b", "smollm2-135m"):
        stem = model_config(preset, ffn="stem")
        moe = model_config(preset, ffn="hash_moe")
        match = acc.hash_moe_match(stem)
        assert match["n_experts"] == moe.n_experts
        # rounding E to an integer leaves at most half an expert (1.5·d·d_ff) of difference per layer
        diff = abs(match["hash_moe_layer_params"] - match["stem_layer_params"])
        assert diff <= 1.5 * stem.d_model * stem.d_ff
        assert abs(acc.total_params(moe) - acc.total_params(stem)) == diff * len(stem.stem_layer_ids)


def test_roi_and_summary():
    assert acc.roi(0.6, 2.0, 0.5, 2.5) == pytest.approx((0.6 / 2.0) / (0.5 / 2.5))
    with pytest.raises(ValueError):
        acc.roi(0.5, 0, 0.5, 1)
    s = acc.summarize(model_config("debug", ffn="stem"), seq_len=64)
    assert s["total_params"] == sum(s["param_breakdown"].values())
    assert s["flops_per_token_train"] == 3 * s["flops_per_token_forward"]
    assert s["vs_dense"]["flops_per_token_forward"] < 1 < s["vs_dense"]["total_params"]
    assert acc.human(1498482688) == "1.50B" and acc.human(3e9, "B") == "3.00GB"


def test_kv_cache_bytes_equal_the_cache_buffers():
    cfg = model_config("debug")
    cache = KVCache(cfg, batch_size=3, max_len=20, dtype=torch.float16)
    real = sum(t.numel() * t.element_size() for t in cache.k + cache.v)
    assert acc.kv_cache_bytes(cfg, 3, 20, dtype_bytes=2) == real
