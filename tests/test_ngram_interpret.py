"""n-gram tables, interpretability and capacity (issue 36): occupancy and collisions against a brute-force
count, distinct keys vs context length, n-gram edits (locality, undo), their CLIs and one-line errors."""

import json
from collections import defaultdict

import numpy as np
import pytest
import torch

from stemlm import StemLM, model_config
from stemlm.analyze.capacity import capacity
from stemlm.analyze.ngram import expected_collision_rate, ngram_key_function, ngram_stats, slot_sharers, stream_keys
from stemlm.analyze.text import windows
from stemlm.checkpoint.directory import save_model
from stemlm.cli import main
from stemlm.data import write_token_split
from stemlm.edit import swap
from stemlm.edit.ngram import canonical_suffixes, key_slots, ngram_edit, ngram_swap, plan_ngram_edit
from stemlm.ffn.ngram import HASH_PRIME, hash_factors
from stemlm.study.measures import capacity_summary


# ---- a brute-force reading of the documented hash (stemlm/ffn/ngram.py) ----

def bf_keys(seq, cfg, canon=None):
    """Keys of every position of ``seq`` (a list, starting its sequence), computed one by one in Python."""
    factors = hash_factors(cfg.ngram_orders, cfg.ngram_heads, cfg.ngram_seed).tolist()
    slots, pad = cfg.ngram_slots or cfg.vocab_size, cfg.vocab_size
    out = []
    for i, t in enumerate(seq):
        keys = [t]
        for o, n in enumerate(cfg.ngram_orders):
            gram = [(canon[seq[j]] if canon is not None else seq[j]) if j >= 0 else pad for j in range(i - n + 1, i + 1)]
            for a, b in factors[o]:
                h = 0
                for u in gram:
                    h = (h * a + u + 1) % HASH_PRIME
                keys.append(h * b % HASH_PRIME % slots)
        out.append(keys)
    return out


def bf_stats(seq, cfg, canon=None):
    """Occupancy and collision counts by dictionaries over every position."""
    keys, H = bf_keys(seq, cfg, canon), cfg.ngram_heads
    slots = cfg.ngram_slots or cfg.vocab_size
    c = (lambda t: canon[t]) if canon is not None else (lambda t: t)
    grams = {}
    for i in range(len(seq)):
        for o, n in enumerate(cfg.ngram_orders):
            g = tuple(c(seq[j]) if j >= 0 else -1 for j in range(i - n + 1, i + 1))
            grams[(n, g)] = keys[i][1 + o * H:1 + (o + 1) * H]
    owners = defaultdict(set)
    for t in set(seq):
        owners[t].add(("token", t))
    for owner, ks in grams.items():
        for s in ks:
            owners[s].add(owner)
    per_order = {}
    for n in cfg.ngram_orders:
        mine = {g: ks for g, ks in grams.items() if g[0] == n}
        collided = {g: [len(owners[s] - {g}) > 0 for s in ks] for g, ks in mine.items()}
        per_order[n] = {"ngrams": len(mine), "colliding_keys": sum(sum(v) for v in collided.values()),
                        "all_heads": sum(all(v) for v in collided.values()),
                        "heads_shared": sum(len(set(ks)) < len(ks) for ks in mine.values())}
    hit = {k for ks in keys for k in ks}
    return {"slots_hit": len(hit), "occupancy": len(hit) / slots, "per_order": per_order,
            "hashed_keys": len(grams) * H, "tokens": len(set(seq))}


@pytest.mark.parametrize("fields, fold", [
    (dict(ngram_slots=4096), False),
    (dict(ngram_slots=700, ngram_orders=(2, 4), ngram_heads=3, ngram_seed=7), False),
    (dict(ngram_slots=1024, ngram_normalize=True), True),  # canonical tokens: 2k+1 folds onto 2k
])
def test_occupancy_and_collisions_match_a_brute_force_count(fields, fold):
    cfg = model_config("debug", ffn="ngram", **fields)
    keys = ngram_key_function(cfg)
    canon = None
    if fold:
        keys.canon.copy_(torch.arange(cfg.vocab_size) // 2 * 2)
        canon = keys.canon.tolist()
    rng = np.random.default_rng(0)
    seq = rng.integers(0, 24, size=400).tolist()
    got, want = ngram_stats(keys, np.array(seq)), bf_stats(seq, cfg, canon)
    assert stream_keys(keys, np.array(seq), chunk=37).tolist() == bf_keys(seq, cfg, canon)  # chunks carry context
    assert got["slots_hit"] == want["slots_hit"] and got["occupancy"] == pytest.approx(want["occupancy"])
    assert got["distinct_tokens"] == want["tokens"] and got["keys_per_position"] == 1 + len(cfg.ngram_orders) * cfg.ngram_heads
    expected = expected_collision_rate(want["tokens"], want["hashed_keys"], cfg.ngram_heads, cfg.ngram_slots)
    total = {"ngrams": 0, "colliding_keys": 0}
    for n, w in want["per_order"].items():
        g = got["collisions"][f"order_{n}"]
        assert g["ngrams"] == w["ngrams"] and g["colliding_keys"] == w["colliding_keys"]
        assert g["collision_rate"] == pytest.approx(w["colliding_keys"] / (w["ngrams"] * cfg.ngram_heads))
        assert g["all_heads_rate"] == pytest.approx(w["all_heads"] / w["ngrams"])
        assert g["heads_shared_rate"] == pytest.approx(w["heads_shared"] / w["ngrams"])
        assert g["expected_uniform"] == pytest.approx(expected)
        total = {k: total[k] + w[k] for k in total}
    overall = got["collisions"]["overall"]
    assert overall["ngrams"] == total["ngrams"] and overall["colliding_keys"] == total["colliding_keys"]
    assert 0 < overall["collision_rate"] < 1  # the toy sizes sit between no and all collisions
    if fold:  # folded spellings are one n-gram, not a collision
        assert got["collisions"]["order_2"]["ngrams"] < len({tuple(seq[i - 1:i + 1]) for i in range(1, len(seq))})


def test_expected_uniform_rate_is_the_simulated_one():
    rng = np.random.default_rng(1)
    slots, tokens, keys, heads = 500, 40, 300, 2
    sims = []
    for _ in range(400):
        other = rng.integers(0, slots, size=keys - heads)
        mine = rng.integers(0, slots)
        sims.append(mine < tokens or (other == mine).any())
    assert np.mean(sims) == pytest.approx(expected_collision_rate(tokens, keys, heads, slots), abs=0.06)


# ---- capacity: distinct keys ----

def test_capacity_counts_distinct_keys_by_brute_force():
    cfg = model_config("debug", ffn="ngram", ngram_slots=2048)
    keys = ngram_key_function(cfg)
    stream = np.random.default_rng(2).integers(0, 60, size=3000)
    res = capacity(stream, 1, cfg.d_ff, cfg.d_model, max_len=256, n_windows=3, seed=5, keys=keys, n_key_layers=1)
    token = capacity(stream, 1, cfg.d_ff, cfg.d_model, max_len=256, n_windows=3, seed=5)
    for n, d, u in zip(res["context_length"], res["distinct_keys"], res["unique_tokens"]):
        want = np.mean([len({k for ks in bf_keys(w.tolist(), cfg) for k in ks}) for w in windows(stream, n, 3, 5)])
        assert d == want and d >= u
    assert res["unique_tokens"] == token["unique_tokens"] and res["heaps"] == token["heaps"]
    assert res["stem_params_activated"] == [cfg.d_ff * d for d in res["distinct_keys"]]
    assert res["distinct_keys"][-1] > res["unique_tokens"][-1] and "heaps_keys" in res and res["keys_per_position"] == 5
    with pytest.raises(ValueError, match="n_key_layers"):
        capacity(stream, 1, 8, 4, max_len=64, n_windows=2, keys=keys, n_key_layers=0)


def test_capacity_summary_uses_keys_for_ngram_layers_only():
    stream = np.random.default_rng(3).integers(0, 200, size=2000)
    stem = model_config("debug", ffn="stem", stem_layers="1/3")
    old = capacity_summary(stream, stem, 64)
    assert set(old) == {"heaps", "unique_tokens_at_seq_len", "table_params_activated_at_seq_len", "dense_up_params",
                        "first_length_exceeding_dense"}  # the token model's summary is unchanged
    mixed = model_config("debug", ffn="stem", stem_layers="1/3", engram_layers="0")  # a token layer and an engram layer
    s = capacity_summary(stream, mixed, 64)
    assert s["table_params_from"] == "keys" and s["n_key_layers"] == 1
    assert s["unique_tokens_at_seq_len"] == old["unique_tokens_at_seq_len"]
    assert s["distinct_keys_at_seq_len"] >= s["unique_tokens_at_seq_len"]
    assert s["table_params_activated_at_seq_len"] == pytest.approx(
        mixed.d_ff * (s["unique_tokens_at_seq_len"] + s["distinct_keys_at_seq_len"]))


# ---- n-gram edits ----

SRC, TGT = [11, 12], [21, 22]  # "a b" takes the rows of "c d"
X = [5, 11, 12]  # the source n-gram at the end
Y = [5, 13, 12]  # the same last token after another token


@pytest.fixture
def ngram_model():
    torch.manual_seed(0)
    cfg = model_config("debug", ffn="ngram", stem_layers="1,2", ngram_slots=8192)
    return StemLM(cfg).eval()


def _logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids]))[0]


def test_ngram_edit_acts_only_after_that_ngram_and_undoes_bitwise(ngram_model):
    model = ngram_model
    state = {k: v.clone() for k, v in model.state_dict().items()}
    bx, by = _logits(model, X), _logits(model, Y)
    plan = plan_ngram_edit(model, SRC, TGT)
    assert plan.orders == [2] and plan.skipped_orders == [3] and plan.layers == [1, 2]
    # the seed and slot count were chosen so that this edit is clean and touches nothing Y reads
    assert plan.clean and not plan.notes and not plan.token_rows and len(plan.slots) == 2
    y_keys = set(model.ngram_keys(torch.tensor([Y]))[0].flatten().tolist())
    assert not y_keys & set(plan.slots) and 12 not in plan.slots
    with ngram_edit(model, SRC, TGT) as record:
        for layer in ("1", "2"):
            w = model.tables[layer].weight
            for key, slot in plan.source_slots.items():
                assert torch.equal(w[slot], state[f"tables.{layer}.weight"][plan.target_slots[key]])
            assert torch.equal(w[12], state[f"tables.{layer}.weight"][12])  # the token row is not written
        ex, ey = _logits(model, X), _logits(model, Y)
        assert not torch.equal(ex[2], bx[2])  # the position preceded by the n-gram changes
        assert torch.equal(ex[:2], bx[:2])  # positions before it do not
        assert torch.equal(ey, by)  # same last token, another preceding token: bitwise unchanged
        assert record.info["slots_written"] == plan.slots and record.info["clean"]
    assert torch.equal(_logits(model, X), bx)
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


def test_ngram_swap_exchanges_rows_and_counts_sharers(ngram_model):
    model = ngram_model
    state = {k: v.clone() for k, v in model.state_dict().items()}
    s, t = key_slots(model, SRC, [2]), key_slots(model, TGT, [2])
    with ngram_swap(model, SRC, TGT):
        w = model.tables["2"].weight
        for key in s:
            assert torch.equal(w[s[key]], state["tables.2.weight"][t[key]])
            assert torch.equal(w[t[key]], state["tables.2.weight"][s[key]])
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    # who else reads the edited slots: exactly the positions whose keys hit them
    stream = np.array(X + Y + X + [7, 8, 9])
    got = slot_sharers(model.ngram_keys, stream, list(s.values()), canonical_suffixes(model, SRC, [2]))
    assert got["ngrams"] == 0 and got["positions"] == 2 and got["sample_tokens"] == []
    got = slot_sharers(model.ngram_keys, stream, list(s.values()))
    assert got["ngrams"] == 1 and got["examples"] == [[11, 12]] and got["by_order"] == {"order_2": 1, "order_3": 0}


def test_shared_slots_are_detected(ngram_model):
    small = StemLM(model_config("debug", ffn="ngram", ngram_slots=512)).eval()  # slots = V: every slot a token row
    # a source whose keys share a slot across heads/orders: the slot takes the mean, the summed memory is kept
    src = next([1, a, b] for a in range(512) for b in range(40)
               if len(set(key_slots(small, [1, a, b], [2, 3]).values())) < 4)
    plan = plan_ngram_edit(small, src, [2, 3, 4])
    assert not plan.clean and "share slot" in plan.notes[0] and plan.token_rows == plan.slots
    w = small.tables["2"].weight
    before = w.detach()[list(plan.target_slots.values())].sum(0)
    with ngram_edit(small, src, [2, 3, 4]):
        torch.testing.assert_close(w.detach()[list(plan.source_slots.values())].sum(0), before)
    # a swap whose two n-grams share a slot is refused, the model untouched
    s = set(key_slots(small, [1, 2], [2]).values())
    other = next([3, b] for b in range(512) if s & set(key_slots(small, [3, b], [2]).values()))
    state = {k: v.clone() for k, v in small.state_dict().items()}
    with pytest.raises(ValueError, match="keys of both n-grams"):
        ngram_swap(small, [1, 2], other)
    assert all(torch.equal(v, state[k]) for k, v in small.state_dict().items())
    assert not plan_ngram_edit(small, [1, 2], other).clean  # a copy is allowed, and said not to be clean


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_ngram_edit_on_offloaded_tiers_equals_in_memory(ngram_model, tmp_path, tier):
    from stemlm.store import open_model, placement_of

    save_model(ngram_model, tmp_path / "ckpt")
    off = open_model(tmp_path / "ckpt", placement_of(tier).replace(writable=True))
    ids = torch.tensor([X + Y + X])
    with torch.no_grad():
        base = off(ids)
        with ngram_edit(ngram_model, SRC, TGT), ngram_edit(off, SRC, TGT):
            torch.testing.assert_close(off(ids), ngram_model(ids), rtol=0, atol=0)
            assert not torch.equal(off(ids), base)
        assert torch.equal(off(ids), base)


def test_ngram_edit_errors_are_one_line(ngram_model):
    stem = StemLM(model_config("debug", ffn="stem")).eval()
    cases = [(lambda: ngram_edit(stem, SRC, TGT), "no n-gram layers"),
             (lambda: ngram_edit(ngram_model, [11], TGT), "at least 2"),
             (lambda: ngram_edit(ngram_model, SRC, TGT, orders=[3]), "longer than the 2-token n-gram"),
             (lambda: ngram_edit(ngram_model, SRC, TGT, orders=[4]), "not one of the model's ngram_orders"),
             (lambda: ngram_edit(ngram_model, SRC, TGT, layers=[0]), "has no table"),
             (lambda: ngram_edit(ngram_model, SRC, [21, 600]), "out of range"),
             (lambda: ngram_edit(ngram_model, SRC, TGT, mode="both"), "unknown mode"),
             (lambda: ngram_edit(ngram_model, "of Spain", TGT), "no tokenizer")]
    mixed = StemLM(model_config("debug", ffn="stem", stem_layers="1/3", engram_layers="0")).eval()
    cases.append((lambda: ngram_edit(mixed, SRC, TGT, layers=[2]), "token-keyed"))
    for call, match in cases:
        with pytest.raises((ValueError, IndexError), match=match) as e:
            call()
        assert "\n" not in str(e.value)
    with ngram_edit(mixed, SRC, TGT) as rec, swap(mixed, [11], [21]) as tok:  # both key kinds in one model
        assert rec.layers == [0] and tok.layers == [0, 2]


# ---- CLIs ----

TEXTS = ["The capital of Spain is Madrid.", "The capital of Germany is Berlin.", "A city of Spain is Seville.",
         "A city of Germany is Hamburg.", "The language of Spain is Spanish."] * 8


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from stemlm.data.codec import TextCodec
    from stemlm.data.tokenizer import train_bpe

    tmp = tmp_path_factory.mktemp("ngram")
    tok = train_bpe(TEXTS, vocab_size=300, extra_tokens=[" Spain", " Germany", " of"])
    cfg = model_config("debug", ffn="ngram", vocab_size=tok.get_vocab_size(), ngram_slots=4096)
    torch.manual_seed(0)
    save_model(StemLM(cfg), tmp / "ckpt")
    tok.save(str(tmp / "ckpt" / "tokenizer.json"))
    codec = TextCodec.of(tok)
    data = tmp / "data"
    write_token_split(data, "val", [np.array(codec.encode(t)) for t in TEXTS], cfg.vocab_size, codec.eos_id)
    tok.save(str(data / "tokenizer.json"))
    stem = model_config("debug", ffn="stem", vocab_size=tok.get_vocab_size())
    save_model(StemLM(stem), tmp / "stem")
    tok.save(str(tmp / "stem" / "tokenizer.json"))
    return tmp, data


def test_analyze_ngram_cli(world, capsys):
    tmp, data = world
    out = tmp / "an"
    assert main(["analyze", "ngram", "--ckpt", str(tmp / "ckpt"), "--data", str(data), "--out", str(out)]) == 0
    res = json.loads((out / "ngram.json").read_text())
    assert res["slots"] == 4096 and 0 < res["occupancy"] < 1 and set(res["collisions"]) == {"order_2", "order_3", "overall"}
    assert (out / "ngram.png").stat().st_size > 0 and "occupancy" in capsys.readouterr().out
    assert main(["analyze", "capacity", "--ckpt", str(tmp / "ckpt"), "--data", str(data), "--out", str(out),
                 "--max-len", "64", "--windows", "2"]) == 0
    cap = json.loads((out / "capacity.json").read_text())
    assert all(d >= u for d, u in zip(cap["distinct_keys"], cap["unique_tokens"])) and cap["n_key_layers"] == 1
    assert main(["analyze", "ngram", "--ckpt", str(tmp / "stem"), "--data", str(data), "--out", str(out)]) == 2
    assert "needs n-gram layers" in capsys.readouterr().err


def test_edit_ngram_cli(world, capsys):
    tmp, data = world
    ckpt, js = str(tmp / "ckpt"), tmp / "e.json"
    before = (tmp / "ckpt" / "model.safetensors").read_bytes()
    assert main(["edit", "--ckpt", ckpt, "--data", str(data), "--ngram-copy", "of Spain=of Germany",
                 "--prompt", "The capital of Spain is", "--top-k", "3", "--json", str(js)]) == 0
    text = capsys.readouterr().out
    assert "edited model, original prompt" in text and "other n-gram(s)" in text
    rep = json.loads(js.read_text())[0]
    assert rep["details"]["orders"] == [2] and rep["details"]["sharers"]["sample_positions"] > 0
    assert rep["panels"][1]["prompt"] == "The capital of Germany is"
    assert (tmp / "ckpt" / "model.safetensors").read_bytes() == before
    for argv, message in [(["--ngram-copy", "Spain=of Germany"], "at least 2"),
                          (["--ngram-swap", "of Spain"], "expects A=B"),
                          (["--ngram-copy", "of Spain=of Germany", "--ngram-orders", "x"], "--ngram-orders"),
                          (["--ngram-copy", "of Spain=of Germany", "--embedding"], "--embedding")]:
        assert main(["edit", "--ckpt", ckpt, "--data", str(data), *argv, "--prompt", "The capital of Spain is"]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1
    assert main(["edit", "--ckpt", str(tmp / "stem"), "--ngram-copy", "of Spain=of Germany", "--prompt", "x"]) == 2
    assert "no n-gram layers" in capsys.readouterr().err
