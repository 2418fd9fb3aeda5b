"""n-gram keyed rows (issue 36) in accounting, the planner, `stemlm info`/`plan`, HF interop and normalisation.

Every count is checked against a built model (its parameters, its keys, its FLOPs) or against sampling.
"""

import json
import shutil

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, models
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

from stemlm import StemLM, model_config
from stemlm import accounting as acc
from stemlm.checkpoint.directory import save_model
from stemlm.cli import main
from stemlm.data.codec import TextCodec, canonical_ids
from stemlm.data.tokenizer import train_bpe
from stemlm.ffn.ngram import keys_per_position
from stemlm.planner import plan, row_use

# the three n-gram kinds, a STEM model with an Engram-style layer, a dense one with it, tied embeddings
CONFIGS = {
    "ngram": dict(ffn="ngram", stem_layers="1/2", ngram_slots=1000),
    "ngram_dagger": dict(ffn="ngram_dagger", stem_layers="1/2", ngram_heads=3),
    "engram": dict(ffn="engram", stem_layers="1/2", ngram_orders=[2, 3, 4], ngram_slots=700),
    "stem+engram": dict(ffn="stem", stem_layers="1/2", engram_layers="2", ngram_slots=2048),
    "dense+engram": dict(ffn="dense", engram_layers="2"),
    "ngram tied": dict(ffn="ngram", stem_layers="full", tie_embeddings=True, ngram_heads=1, ngram_orders=[2]),
}
CPU_SDPA = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu:
            lambda q, k, v, *args, out_shape=None, **kwargs: sdpa_flop_count(q, k, v)}


def _cfg(name):
    return model_config("debug", **CONFIGS[name])


def _rows_read(model: StemLM) -> dict[str, int]:
    """Rows every table layer reads per position, from the model itself: 1 per token layer, the width of
    the keys its n-gram layers gather."""
    ids = torch.randint(0, model.cfg.vocab_size, (1, 5))
    keys = model.layer_keys(ids)
    return {k: 1 if v.dim() == 2 else v.shape[-1] for k, v in keys.items()}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_parameter_counts_equal_the_built_model(name):
    cfg = _cfg(name)
    model = StemLM(cfg)
    assert acc.total_params(cfg) == model.num_parameters() == sum(p.numel() for p in model.parameters())
    tables = {k: t.weight.numel() for k, t in model.tables.items()}
    assert acc.param_breakdown(cfg)["tables"] == sum(tables.values())
    assert {str(i): n * cfg.d_ff for i, n in acc.table_rows_per_layer(cfg).items()} == tables
    engram = [i for i, k in enumerate(cfg.layer_kinds) if k == "engram"]
    for i in engram:  # a SwiGLU plus W_k, W_v: 2·d·d_ff more than a dense layer
        ffn = model.layers[i].ffn
        assert sum(p.numel() for p in ffn.parameters()) == 5 * cfg.d_model * cfg.d_ff
    assert acc.param_breakdown(cfg)["ffn_weights"] == sum(
        p.numel() for n, p in model.named_parameters() if ".ffn." in n)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_active_params_bytes_and_row_sums_count_k_rows(name):
    """Independent count from the module: every weight once, one embedding row, and per table the rows its keys read."""
    cfg = _cfg(name)
    model = StemLM(cfg)
    read = _rows_read(model)
    assert read == {str(i): n for i, n in acc.rows_per_token_of_layer(cfg).items()}
    assert all(read[str(i)] == keys_per_position(cfg) for i in cfg.ngram_layers)
    touched = 0
    for n, p in model.named_parameters():
        if n.startswith("tables."):
            touched += read[n.split(".")[1]] * p.shape[1]
        elif n == "tok_embeddings.weight" and not cfg.tie_embeddings:
            touched += p.shape[1]
        else:
            touched += p.numel()
    assert acc.active_params(cfg, embedding="row") == touched
    assert acc.decode_param_bytes(cfg, dtype_bytes=2) == 2 * touched
    assert acc.table_rows_per_token(cfg) == sum(read.values())
    assert acc.table_bytes_per_token(cfg, 4) == 4 * cfg.d_ff * sum(read.values())
    assert acc.table_sum_adds_per_token(cfg) == cfg.d_ff * sum(read[str(i)] - 1 for i in cfg.ngram_layers)
    slots = acc.train_step_bytes(cfg, 64)["tables"] / (cfg.d_ff * acc.TABLE_STEP_BYTES)
    assert slots == sum(min(64 * read[str(i)], cfg.table_rows(i)) for i in cfg.table_layers)


@pytest.mark.parametrize("name", ["ngram", "ngram_dagger", "engram", "stem+engram"])
def test_forward_flops_match_the_flop_counter(name):
    """Matmuls only: an engram layer's W_k m and W_v m are counted, the K-row sum and the gate are not."""
    cfg = _cfg(name)
    model, seq = StemLM(cfg).eval(), 8
    ids = torch.randint(0, cfg.vocab_size, (1, seq))
    with torch.no_grad(), FlopCounterMode(display=False, custom_mapping=CPU_SDPA) as counter:
        model(ids)
    assert counter.get_total_flops() == seq * acc.forward_flops_per_token(cfg, seq)


def test_summary_reports_the_ngram_settings():
    cfg = model_config("debug", ffn="stem", stem_layers="1/2", engram_layers="2", ngram_slots=900, ngram_seed=3,
                       ngram_normalize=True)
    r = acc.summarize(cfg)
    assert r["ngram"] == {"orders": [2, 3], "heads": 2, "slots": 900, "keys_per_position": 5, "seed": 3,
                          "normalize": True, "layers": [2], "engram_layers": [2]}
    assert r["table_rows"] == {"1": 512, "2": 900, "3": 512} and r["table_rows_per_token"] == 7
    assert acc.summarize(model_config("debug", ffn="stem"))["ngram"] is None
    # the dense counterpart has no engram layer either
    assert r["vs_dense"]["total_params"] == acc.total_params(cfg) / acc.total_params(model_config("debug", ffn="dense"))


def _run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_info_prints_the_ngram_fields(capsys):
    code, out, _ = _run(capsys, "info", "--ffn", "ngram", "model.ngram_slots=1024", "model.ngram_heads=3",
                        "model.ngram_seed=7", "model.ngram_normalize=true")
    assert code == 0
    assert "orders 2,3, 3 hash heads/order, K = 7 rows/position" in out
    assert "1024 slots/table, seed 7, normalize on; n-gram layers 2" in out and "2 ngram 1024 rows" in out
    assert "table rows read per token" in out and "row-sum adds/token (not in FLOPs)" in out
    kinds = [line.split()[1] for line in out.splitlines() if line.split()[:1] and line.split()[0].isdigit()]
    assert kinds == ["dense", "dense", "ngram", "dense"]
    code, out, _ = _run(capsys, "info", "--ffn", "stem", "model.engram_layers=1", "--json")
    r = json.loads(out)
    assert code == 0 and r["layer_kinds"] == ["dense", "engram", "stem", "dense"] and r["ngram"]["engram_layers"] == [1]
    code, _, err = _run(capsys, "info", "--ffn", "ngram", "model.ngram_slots=100")
    assert code == 2 and "ngram_slots=100 must be >= vocab_size=512" in err and err.count("\n") == 1


def test_plan_prints_the_ngram_tables_and_its_approximation(capsys):
    code, out, _ = _run(capsys, "plan", "--ffn", "stem", "model.engram_layers=1", "model.ngram_slots=2048",
                        "--cache-frac", "0.1", "--batch", "2")
    assert code == 0 and "table rows: layer 1 2048, layer 2 512; 6 rows read per token" in out
    assert "n-gram tables (layers 1): K = 5 keys/position" in out and "over-estimate" in out
    assert "layer 1 (engram, 5 keys/token, 2048 rows)" in out and "layer 2 (stem, 1 keys/token, 512 rows)" in out
    code, out, _ = _run(capsys, "plan", "--ffn", "ngram", "model.ngram_slots=4096", "--tables", "disk", "--train", "--json")
    p = json.loads(out)
    assert code == 0 and p["table_rows"] == {"2": 4096} and p["ngram"]["slots"] == 4096 and p["ngram_model"]
    assert p["disk_bytes"]["tables_and_state"] == 4096 * 128 * (2 + 8)


def test_plan_memory_and_rows_per_table():
    cfg = model_config("debug", ffn="stem", stem_layers="1/2", engram_layers="2", ngram_slots=2000)
    p = plan(cfg, tables="host", cache_frac=0.25, batch=2, seq_len=64)
    assert p["cache_rows"] is None and p["cache_rows_per_layer"] == {"1": 128, "2": 500, "3": 128}
    assert p["host_bytes"]["tables_and_state"] == (512 + 2000 + 512) * cfg.d_ff * 2
    assert p["accelerator_bytes"]["row_cache"] == (128 + 500 + 128) * cfg.d_ff * 2
    for s in p["steps"].values():
        layers = s["layers"]
        assert s["rows_to_move"] == pytest.approx(sum(r["rows_to_move"] for r in layers.values()))
        assert s["bytes_to_move"] == pytest.approx(s["rows_to_move"] * cfg.d_ff * 2)
        assert layers["2"]["unique_rows"] > layers["1"]["unique_rows"] == pytest.approx(layers["3"]["unique_rows"])
        assert layers["1"]["unique_rows"] == pytest.approx(acc.unique_rows_estimate(s["tokens"], 512))
    train = plan(cfg, tables="host", batch=2, seq_len=64, train=True)
    mem = train["train_memory"]
    assert mem["device"] - (acc.total_params(cfg) - acc.param_breakdown(cfg)["tables"]) * (2 + 2 + 8) == \
        (512 + 2000 + 512) * cfg.d_ff * (2 + 8)


def test_distinct_ngrams_estimate_is_exact_under_independence():
    for vocab, order, n, s in ((40, 2, 300, 1.0), (30, 3, 2000, 1.1), (64, 2, 50, 0.0)):
        p = acc.zipf_probabilities(vocab, s)
        joint = p
        for _ in range(order - 1):
            joint = np.outer(joint, p).ravel()
        exact = float(-np.expm1(n * np.log1p(-joint)).sum())
        assert acc.distinct_ngrams_estimate(n, vocab, order, s) == pytest.approx(exact, rel=1e-4)
    assert acc.distinct_ngrams_estimate(1, 512, 3) == pytest.approx(1)
    assert acc.distinct_ngrams_estimate(10**4, 512, 2) < 10**4


def test_row_use_matches_the_keys_of_sampled_batches():
    """With i.i.d. Zipf tokens (the planner's law, ids in rank order) the model of an n-gram table's
    distinct rows holds for the real keys: tokens plus uniformly hashed n-grams."""
    cfg = model_config("debug", ffn="ngram", stem_layers="2", ngram_slots=1500)
    model = StemLM(cfg)
    rng = np.random.default_rng(0)
    p = acc.zipf_probabilities(cfg.vocab_size, 1.0)
    for n in (8, 256):
        seen, missed = [], []
        for _ in range(40):
            keys = model.ngram_keys(torch.from_numpy(rng.choice(cfg.vocab_size, size=(1, n), p=p))).unique()
            seen.append(len(keys))
            missed.append(int((keys >= 50).sum()))  # outside a cache of the 50 most used rows
        use = row_use(cfg, 2, n, 1.0)
        assert use.rows == 1500
        assert use.distinct() == pytest.approx(np.mean(seen), rel=0.05)
        assert use.distinct(50) == pytest.approx(np.mean(missed), rel=0.05)


# -- HF export and transformers ------------------------------------------------------------------
def test_export_to_llama_is_refused_naming_the_kinds(tmp_path, capsys):
    from stemlm.interop.convert import stem_to_llama

    with pytest.raises(ValueError, match=r"model has ngram layers \[1, 3\]; only an all-dense .*cannot hold"):
        stem_to_llama(StemLM(_cfg("ngram")))
    save_model(StemLM(_cfg("stem+engram")), tmp_path / "mixed")
    code, _, err = _run(capsys, "convert", "--to-hf", "--ckpt", str(tmp_path / "mixed"), "--out", str(tmp_path / "out"))
    assert code == 2 and err.count("\n") == 1
    assert "model has stem layers [1, 3] and engram layers [2]; only an all-dense stemlm model exports to Llama" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("kind", ["ngram", "ngram_dagger", "engram"])
def test_convert_from_a_dense_llama_refuses_ngram_kinds(capsys, tmp_path, kind):
    code, _, err = _run(capsys, "convert", "--from-hf", str(tmp_path), "--out", str(tmp_path / "o"), "--ffn", kind)
    assert code == 2 and err.count("\n") == 1 and f"ffn '{kind}' does not convert from a dense Llama" in err


def _hf(name):
    from stemlm.interop.hf import StemConfig, StemForCausalLM

    hf = StemForCausalLM(StemConfig.from_model_config(_cfg(name), pad_token_id=0)).eval()
    with torch.no_grad():  # rows large enough that a wrong key changes the greedy tokens
        for table in hf.model.tables.values():
            table.weight.mul_(30)
    return hf


@pytest.mark.parametrize("name", ["ngram", "stem+engram"])
def test_hf_generate_with_a_cache_passes_the_ngram_context(name):
    from transformers import DynamicCache

    hf = _hf(name)
    prompt = torch.randint(3, 512, (2, 5))
    kw = dict(max_new_tokens=5, min_new_tokens=5, do_sample=False)
    cached = hf.generate(prompt, **kw)
    assert torch.equal(cached, hf.generate(prompt, use_cache=False, **kw))
    seq = prompt
    with torch.no_grad():  # full forward every step: keys with their whole context
        for _ in range(5):
            seq = torch.cat([seq, hf.model(seq)[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(cached, seq)
    x = torch.randint(3, 512, (2, 9))
    with torch.no_grad():
        full, kv = hf(x).logits, DynamicCache(config=hf.config)
        first = hf(x[:, :6], cache=kv).logits
        rest = hf(x[:, 6:], cache=kv, ngram_context=x[:, 4:6]).logits
        torch.testing.assert_close(torch.cat([first, rest], 1), full, rtol=1e-5, atol=1e-5)
        with pytest.raises(ValueError, match="pass ngram_context"):
            hf(x[:, 6:], cache=kv)


def test_hf_left_padded_batch_keys_as_each_prompt_alone():
    hf = _hf("ngram")
    prompts = [torch.randint(3, 512, (n,)).tolist() for n in (3, 7, 5)]
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    kw = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False)
    batched = hf.generate(input_ids=ids, attention_mask=mask, **kw)[:, width:]
    for row, p in zip(batched, prompts):
        assert row.tolist() == hf.generate(torch.tensor([p]), **kw)[0, len(p):].tolist()


# -- normalisation -------------------------------------------------------------------------------
WORDS = [" Spain", "Spain", " spain", "spain", " France", " Über", "über"]


def _bpe():
    text = ["The capital of Spain is Madrid. spain, Spain; France and Über über."] * 20
    return train_bpe(text, vocab_size=300, extra_tokens=WORDS, min_frequency=1)


def _id(tok, word):
    ids = tok.encode(word).ids
    assert len(ids) == 1, word
    return ids[0]


def test_canonical_ids_fold_case_and_the_leading_space():
    tok = _bpe()
    canon = canonical_ids(tok)
    assert canon.dtype == torch.long and canon.shape == (tok.get_vocab_size(),)
    spain = _id(tok, "spain")
    assert [int(canon[_id(tok, w)]) for w in (" Spain", "Spain", " spain", "spain")] == [spain] * 4
    assert int(canon[_id(tok, " Über")]) == _id(tok, "über")  # byte-level tokens folded as UTF-8 text
    assert int(canon[_id(tok, " France")]) == _id(tok, " France")  # no "france" token: itself
    assert int(canon[tok.token_to_id("<|endoftext|>")]) == tok.token_to_id("<|endoftext|>")
    assert torch.equal(canon[canon], canon)  # idempotent
    assert torch.equal(canonical_ids(TextCodec(tok)), canon)
    wide = canonical_ids(tok, vocab_size=512)  # a model vocabulary beyond the tokenizer's
    assert torch.equal(wide[:len(canon)], canon) and torch.equal(wide[len(canon):], torch.arange(len(canon), 512))


def test_canonical_ids_of_a_sentencepiece_vocabulary():
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "\u2581Spain": 1, "Spain": 2, "spain": 3, "\u2581the": 4, "The": 5, "x": 6}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    assert canonical_ids(tok).tolist() == [0, 3, 3, 3, 4, 5, 6]  # "the" is no token: "▁the" and "The" stay
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")
    assert torch.equal(canonical_ids(hf), canonical_ids(tok))


def test_normalized_keys_of_spain_and_spain_share_their_ngram_slots():
    tok = _bpe()
    base = dict(ffn="ngram", stem_layers="1/2", vocab_size=tok.get_vocab_size(), ngram_slots=4096)
    plain = StemLM(model_config("debug", **base))
    norm = StemLM(model_config("debug", **base, ngram_normalize=True))
    with torch.no_grad():
        norm.ngram_keys.canon.copy_(canonical_ids(tok, norm.cfg.vocab_size))
    the, is_ = _id(tok, " France"), tok.encode(" is").ids[-1]
    a = torch.tensor([[the, _id(tok, "Spain"), is_]])
    b = torch.tensor([[the, _id(tok, " spain"), is_]])
    ka, kb = norm.ngram_keys(a), norm.ngram_keys(b)
    assert torch.equal(ka[..., 1:], kb[..., 1:])  # every hashed n-gram slot the same
    assert not torch.equal(ka[:, 1, 0], kb[:, 1, 0])  # the token rows stay the tokens'
    pa, pb = plain.ngram_keys(a), plain.ngram_keys(b)
    assert not torch.equal(pa[:, 1:, 1:], pb[:, 1:, 1:]) and torch.equal(pa[:, 0], pb[:, 0])


def test_training_fills_the_canonical_map_once_and_checkpoints_carry_it(tmp_path):
    from train_helpers import debug_config, make_token_data

    from stemlm.checkpoint.directory import resolve_checkpoint
    from stemlm.store import open_model
    from stemlm.train import Trainer, train

    data = make_token_data(tmp_path / "data")
    tok = _bpe()
    tok.save(str(data / "tokenizer.json"))
    cfg = debug_config(data, tmp_path / "run", "model.ffn=ngram", "model.ngram_normalize=true", "run.steps=1")
    trainer = Trainer(cfg)
    expected = canonical_ids(tok, trainer.model.cfg.vocab_size)
    assert (expected != torch.arange(len(expected))).any()
    assert torch.equal(trainer.model.ngram_keys.canon.cpu(), expected)
    trainer.close()
    train(cfg)
    ckpt, bare_ckpt = resolve_checkpoint(tmp_path / "run"), tmp_path / "weights_only"
    bare_ckpt.mkdir()  # loading needs no tokenizer: the map is in the weights
    for name in ("config.json", "model.safetensors"):
        shutil.copy2(ckpt / name, bare_ckpt / name)
    assert torch.equal(open_model(bare_ckpt).ngram_keys.canon, expected)
    bare = make_token_data(tmp_path / "bare")  # no tokenizer to read: one clear error
    with pytest.raises(Exception, match="ngram_normalize needs the data's tokenizer"):
        Trainer(debug_config(bare, tmp_path / "run2", "model.ffn=ngram", "model.ngram_normalize=true"))


def test_token_counts_warm_the_token_rows_of_an_ngram_table(tmp_path):
    """Warm-start counts are per token (V entries): they warm rows 0..V-1 of an n-gram table of more rows."""
    from stemlm.store import Placement, open_model

    model = StemLM(_cfg("ngram")).eval()
    save_model(model, tmp_path / "c")
    counts = np.zeros(512, dtype=np.int64)
    counts[[5, 9, 11]] = [30, 20, 10]
    host = open_model(tmp_path / "c", Placement(tier="host", cache_rows=4, warm_counts=counts))
    table = next(iter(host.tables.values()))
    assert table.num_rows == 1000 and table.cache.resident_ids().tolist() == [5, 9, 11]
    ids = torch.randint(0, 512, (1, 6))
    with torch.no_grad():
        torch.testing.assert_close(host(ids), model(ids), rtol=0, atol=0)
