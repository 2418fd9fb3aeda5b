"""n-gram keyed rows (stemlm.ffn.ngram): the keys, every kind on every tier, decode, training and resume."""

import pytest
import torch
from train_helpers import losses, make_token_data, one_thread  # noqa: F401

from stemlm.cli import main
from stemlm.config import ConfigError, ModelConfig
from stemlm.ffn.ngram import HASH_PRIME, hash_factors, hash_plan, keys_per_position, ngram_keys
from stemlm.inference.core import DecodeCore, Generation
from stemlm.inference.sampling import SamplingParams
from stemlm.model.decoder import StemLM
from stemlm.store import Placement
from stemlm.store.offload import offload_tables

QUIET = ["run.peak_flops=1e11", "run.progress=false", "run.plots=false"]
KINDS = [dict(ffn="ngram"), dict(ffn="ngram_dagger"), dict(ffn="engram"), dict(ffn="stem", engram_layers="1")]


def _model(seed=0, **kw):
    torch.manual_seed(seed)
    return StemLM(ModelConfig(max_seq_len=64, **kw)).eval()


def _python_key(tokens, a, b, slots):
    """The documented hash, in Python integers: h = (h·a + u + 1) mod P over the n-gram, then (h·b mod P) mod slots."""
    h = 0
    for u in tokens:
        h = (h * a + u + 1) % HASH_PRIME
    return (h * b) % HASH_PRIME % slots


def test_keys_follow_the_documented_hash_and_pad_the_sequence_start():
    cfg = ModelConfig(ffn="ngram", ngram_orders=(2, 3), ngram_heads=2, ngram_slots=700)
    ids = torch.tensor([[5, 9, 9, 300]])
    f = hash_factors(cfg.ngram_orders, cfg.ngram_heads, cfg.ngram_seed)
    keys = ngram_keys(ids, None, cfg, hash_plan(cfg.ngram_orders, cfg.ngram_heads, cfg.ngram_seed))
    assert keys.shape == (1, 4, keys_per_position(cfg)) == (1, 4, 5)
    assert keys[0, :, 0].tolist() == ids[0].tolist()  # key 0: the token itself
    pad = cfg.vocab_size  # a position before the start hashes as V
    seq = [pad, pad, *ids[0].tolist()]
    for i in range(4):
        for o, n in enumerate(cfg.ngram_orders):
            gram = seq[2 + i - n + 1:2 + i + 1]
            for h in range(cfg.ngram_heads):
                a, b = f[o, h].tolist()
                assert keys[0, i, 1 + o * cfg.ngram_heads + h] == _python_key(gram, a, b, 700)
    assert int(keys.max()) < 700 and int(keys.min()) >= 0
    assert torch.equal(ngram_keys(ids, None, cfg, hash_plan((2, 3), 2, 0)), keys)  # deterministic
    assert not torch.equal(ngram_keys(ids, None, cfg, hash_plan((2, 3), 2, 1)), keys)  # the seed matters


def test_context_gives_the_keys_of_the_longer_sequence():
    cfg = ModelConfig(ffn="ngram", ngram_orders=(2, 3, 4))
    f = hash_plan(cfg.ngram_orders, cfg.ngram_heads, 0)
    ids = torch.randint(0, cfg.vocab_size, (3, 12))
    full = ngram_keys(ids, None, cfg, f)
    for cut in (1, 2, 5):
        tail = ngram_keys(ids[:, cut:], ids[:, :cut], cfg, f)  # context shorter than the reach is padded as the start
        assert torch.equal(tail, full[:, cut:])
    ctx = torch.full((3, 3), -1)  # -1: before the start
    assert torch.equal(ngram_keys(ids, ctx, cfg, f), full)


@pytest.mark.parametrize("kw, message", [
    (dict(ngram_orders=[]), "ngram_orders: empty"),
    (dict(ngram_orders=[1, 2]), "must each be in 2..8"),
    (dict(ngram_orders=[2, 2]), "duplicate order"),
    (dict(ngram_heads=0), "ngram_heads must be in 1..16"),
    (dict(ngram_slots=100), "ngram_slots=100 must be >= vocab_size=512"),
    (dict(ngram_seed=-1), "ngram_seed must be >= 0"),
    (dict(ffn="stem", stem_layers="1/2", engram_layers="1"), "engram_layers: layer 1 is already a stem layer"),
])
def test_bad_ngram_settings_are_one_line_errors(kw, message):
    with pytest.raises(ConfigError, match=message) as e:
        ModelConfig(**{"ffn": "ngram", **kw})
    assert "\n" not in str(e.value)


def test_tables_hold_ngram_slots_and_layers_get_their_keys():
    m = _model(ffn="stem", engram_layers="1", ngram_slots=600)
    assert m.cfg.layer_kinds == ("dense", "engram", "stem", "dense") and m.mixed_keys
    assert tuple(m.tables["1"].weight.shape) == (600, m.cfg.d_ff) and tuple(m.tables["2"].weight.shape) == (512, m.cfg.d_ff)
    ids = torch.randint(0, 512, (2, 6))
    keys = m.layer_keys(ids)
    assert torch.equal(keys["2"], ids) and keys["1"].shape == (2, 6, 5)
    assert m.cfg.to_dict()["engram_layers"] == "1" and ModelConfig.from_dict(m.cfg.to_dict()) == m.cfg


def _greedy(model, prompt, n=10, graphs="off"):
    core = DecodeCore(model, graphs=graphs)
    g = Generation(list(prompt), SamplingParams(max_new_tokens=n, temperature=0.0))
    core.add([g])
    while core.running:
        core.step()
    return g.tokens


@pytest.mark.parametrize("kw", KINDS, ids=lambda kw: "+".join(str(v) for v in kw.values()))
def test_cached_decode_equals_the_full_forward_on_every_tier(kw, tmp_path):
    model = _model(**kw, ngram_slots=640)
    prompt = torch.randint(0, 512, (7,), generator=torch.Generator().manual_seed(1)).tolist()
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(10):
            seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
    want = seq[len(prompt):]
    assert _greedy(model, prompt) == want and _greedy(model, prompt, graphs="static") == want
    for tier, extra in (("host", dict(cache_rows=16)), ("disk", dict(tables_file=tmp_path / f"{kw['ffn']}.safetensors"))):
        off = _model(**kw, ngram_slots=640)
        offload_tables(off, Placement(tier, **extra))
        assert _greedy(off, prompt) == want, tier
        assert _greedy(off, prompt, graphs="static") == want, tier
        assert off.tables.stats()["rows_moved"] > 0
        off.tables.close()


def test_a_batch_of_ragged_sequences_decodes_as_each_alone():
    model = _model(ffn="ngram")
    prompts = [[3, 4, 5], [9, 8, 7, 6, 5, 4], [100]]
    alone = [_greedy(model, p, n=6) for p in prompts]
    core = DecodeCore(model, graphs="off")
    gens = [Generation(p, SamplingParams(max_new_tokens=6, temperature=0.0)) for p in prompts]
    core.add(gens)
    while core.running:
        core.step()
    assert [g.tokens for g in gens] == alone


def test_the_rows_a_step_touches_are_the_distinct_keys_of_its_batch():
    model = _model(ffn="ngram", stem_layers="1/2").train()
    for t in model.tables.values():
        t.sparse_grad = True
    ids = torch.randint(0, 60, (2, 16))
    model(ids, targets=ids).backward()
    want = torch.unique(model.table_keys(ids))
    touched = model.tables.take_step()
    for key, t in model.tables.items():
        ((uniq, rows),) = touched.of(key)
        assert torch.equal(uniq, want) and rows.grad.shape == (len(want), model.cfg.d_ff)
        assert rows.grad.abs().sum(1).gt(0).all()  # every touched slot gets a gradient
        dense = torch.zeros_like(t.weight)
        dense.index_add_(0, uniq, rows.grad)
        assert torch.count_nonzero(dense.abs().sum(1)) == len(want)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return make_token_data(tmp_path_factory.mktemp("data"))


@pytest.mark.parametrize("extra", [
    ["--ffn", "ngram"],
    ["--ffn", "engram", "optim.table_optimizer=dense"],
    ["--ffn", "stem", "model.engram_layers=1"],
    ["--ffn", "ngram_dagger", "run.table_path=fused"],
    ["--ffn", "ngram", "run.table_path=fused", "run.tables=host"],
], ids=["ngram", "engram-dense-optim", "stem+engram", "dagger-fused", "ngram-host"])
def test_every_placement_trains_and_resumes_bit_for_bit(extra, data_dir, tmp_path):
    base = ["train", "--preset", "debug", "--data", str(data_dir), *QUIET, "--steps", "8", "run.ckpt_every=4", *extra]
    assert main([*base, "--out", str(tmp_path / "full")]) == 0
    assert main([*base, "--out", str(tmp_path / "cut"), "--stop-at", "4"]) == 0
    assert main([*base, "--out", str(tmp_path / "cut"), "--resume"]) == 0
    assert losses(tmp_path / "cut") == losses(tmp_path / "full")
    assert len(losses(tmp_path / "full")) >= 8


def test_fused_and_reference_paths_agree(data_dir, tmp_path):
    """The stacked fused path and the per-table reference path train an n-gram model to the same losses."""
    base = ["train", "--preset", "debug", "--data", str(data_dir), *QUIET, "--steps", "5", "--ffn", "ngram",
            "optim.table_optimizer=sparse"]
    assert main([*base, "--out", str(tmp_path / "ref"), "run.table_path=reference"]) == 0
    assert main([*base, "--out", str(tmp_path / "fused"), "run.table_path=fused"]) == 0
    assert losses(tmp_path / "fused") == pytest.approx(losses(tmp_path / "ref"), rel=1e-5, abs=1e-6)


def test_a_mixed_model_refuses_the_fused_path_in_one_line(data_dir, tmp_path, capsys):
    assert main(["train", "--preset", "debug", "--data", str(data_dir), *QUIET, "--steps", "2", "--ffn", "stem",
                 "model.engram_layers=1", "run.table_path=fused", "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err and "run.table_path=fused needs" in err[-1]


def test_a_checkpoint_opens_on_every_tier_and_generates_the_same_tokens(data_dir, tmp_path):
    from stemlm.store import open_model

    out = tmp_path / "run"
    assert main(["train", "--preset", "debug", "--data", str(data_dir), *QUIET, "--steps", "3", "--ffn", "ngram",
                 "model.ngram_slots=600", "--out", str(out)]) == 0
    prompt = [5, 6, 7, 8]
    want = {}
    for tier, dtype in (("device", None), ("host", None), ("disk", None), ("device", "int8"), ("host", "int8")):
        model = open_model(out, Placement(tier, table_dtype=dtype))
        assert tuple(model.tables["2"].read_rows(torch.arange(600)).shape) == (600, model.cfg.d_ff)
        tokens = _greedy(model, prompt, n=6)
        assert want.setdefault(dtype, tokens) == tokens, (tier, dtype)
        model.tables.close()


def test_the_small_python_path_gives_the_tensor_path_keys(monkeypatch):
    import stemlm.ffn.ngram as ng

    cfg = ModelConfig(ffn="ngram", ngram_orders=(2, 4), ngram_heads=3, ngram_slots=5000)
    plan = hash_plan(cfg.ngram_orders, cfg.ngram_heads, 7)
    gen = torch.Generator().manual_seed(0)
    for B, T, c in ((4, 1, 3), (2, 3, 1), (1, 5, 0), (3, 2, None)):
        ids = torch.randint(0, cfg.vocab_size, (B, T), generator=gen)
        ctx = None if c is None else torch.randint(-1, cfg.vocab_size, (B, c), generator=gen)
        small = ngram_keys(ids, ctx, cfg, plan)
        monkeypatch.setattr(ng, "SMALL", 0)
        assert torch.equal(small, ngram_keys(ids, ctx, cfg, plan)), (B, T, c)
        monkeypatch.setattr(ng, "SMALL", 16)


def test_decode_keys_from_token_lists_equal_the_keys_of_the_whole_sequence():
    """``newest_keys`` (what the decode core hashes from its token lists) gives the keys the tensor path gives the
    last position of each whole sequence: sequences shorter than the longest order included."""
    from stemlm.ffn.ngram import hash_columns, newest_keys

    cfg = ModelConfig(ffn="ngram", ngram_orders=(2, 4), ngram_heads=3, ngram_slots=5000)
    plan = hash_plan(cfg.ngram_orders, cfg.ngram_heads, cfg.ngram_seed)
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist() for n in (1, 2, 3, 4, 9)]
    got = newest_keys([s[-4:] for s in seqs], cfg, hash_columns(plan))  # N = 4: the window of the newest token
    for j, s in enumerate(seqs):
        want = ngram_keys(torch.tensor([s]), None, cfg, plan)[0, -1]
        assert torch.equal(got[j, 0], want), len(s)


def test_decode_hashes_from_token_lists_with_the_full_forwards_tokens(monkeypatch):
    """The decode core's keys from its token lists (``DecodeCore._step_keys``) lead to the tokens of the
    tensor path (the model's own ``table_keys`` of ids and context)."""
    from stemlm.inference.core import DecodeCore

    torch.manual_seed(0)
    model = StemLM(ModelConfig(ffn="ngram", ngram_orders=(2, 3), vocab_size=97, d_model=32, n_layers=3, n_heads=2,
                               n_kv_heads=1, d_ff=48, max_seq_len=64, stem_layers="full")).eval()
    prompts = [[5], [7, 8, 9, 10, 11], [3, 4]]
    fast = _greedy_batch(model, prompts)
    monkeypatch.setattr(DecodeCore, "_step_keys", lambda self, seqs: None)  # the ids-and-context path
    assert _greedy_batch(model, prompts) == fast


def _greedy_batch(model, prompts, n=8):
    from stemlm.inference.core import DecodeCore, Generation
    from stemlm.inference.sampling import SamplingParams

    core = DecodeCore(model, graphs="off")
    gens = [Generation(p, SamplingParams(max_new_tokens=n, temperature=0.0)) for p in prompts]
    core.add(gens)
    while core.running:
        core.step()
    return [g.tokens for g in gens]
