"""Hugging Face interop: Llama <-> stemlm parity, Auto-class loading, generate() with a cache, errors."""

import dataclasses
import json

import pytest
import torch
import torch.nn as nn
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

import stemlm  # noqa: F401  (registers the Auto classes)
from stemlm import ModelConfig, StemLM, model_config
from stemlm.checkpoint.directory import CheckpointError, save_model
from stemlm.store import open_model
from stemlm.cli import main
from stemlm.interop.convert import convert_from_hf, convert_to_hf, llama_name, llama_to_stem, stem_to_llama
from stemlm.interop.hf import StemConfig, StemForCausalLM

V = 128
SENTENCES = ["the cat sat on the mat", "a dog ran in the park", "the capital of france is paris",
             "stem tables hold one row per token"] * 4


def tiny_llama(tie: bool = False, **overrides) -> LlamaForCausalLM:
    """A random fp32 Llama with GQA; norms perturbed so that copying them matters."""
    kwargs = dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=96, vocab_size=V, max_position_embeddings=64, rms_norm_eps=1e-6,
                  rope_parameters={"rope_type": "default", "rope_theta": 5000.0}, tie_word_embeddings=tie,
                  bos_token_id=1, eos_token_id=2)
    cfg = LlamaConfig(**{**kwargs, **overrides})
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def tiny_tokenizer(extra_tokens: int = 0) -> PreTrainedTokenizerFast:
    """A byte-level BPE trained here on a few sentences (no hub)."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(SENTENCES, trainers.BpeTrainer(vocab_size=100, special_tokens=["<unk>", "<s>", "</s>"]))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.add_tokens([f"<extra{i}>" for i in range(extra_tokens)])
    return fast


def llama_dir(tmp_path, tie=False, tokenizer=True, extra_tokens=0):
    """A Llama model directory (+ tokenizer) as written by save_pretrained."""
    model = tiny_llama(tie)
    path = tmp_path / f"llama_tie{int(tie)}"
    model.save_pretrained(path)
    if tokenizer:
        tiny_tokenizer(extra_tokens).save_pretrained(path)
    return model, path


def ids(batch=2, length=12):
    return torch.randint(3, V, (batch, length))


# -- conversion parity -------------------------------------------------------------------------
@pytest.mark.parametrize("tie", [False, True])
def test_llama_to_stem_dense_matches_logits(tie):
    llama = tiny_llama(tie)
    stem = llama_to_stem(llama)
    assert stem.cfg.tie_embeddings == tie and stem.cfg.n_kv_heads == 2 and stem.cfg.rope_theta == 5000.0
    x = ids()
    with torch.no_grad():
        assert (llama(x).logits - stem(x)).abs().max() <= 1e-5


@pytest.mark.parametrize("tie", [False, True])
def test_stem_dense_to_llama_matches_logits(tie):
    stem = StemLM(model_config("debug", ffn="dense", vocab_size=V, tie_embeddings=tie)).eval()
    llama = stem_to_llama(stem)
    x = ids()
    with torch.no_grad():
        torch.testing.assert_close(llama(x).logits, stem(x), rtol=0, atol=1e-5)


def test_directory_round_trip_carries_weights_and_tokenizer(tmp_path):
    llama, src = llama_dir(tmp_path)
    ckpt = convert_from_hf(src, tmp_path / "stem")
    back = convert_to_hf(ckpt, tmp_path / "back")
    x = ids()
    with torch.no_grad():
        ref = llama(x).logits
        torch.testing.assert_close(open_model(ckpt)(x), ref, rtol=0, atol=1e-5)
        torch.testing.assert_close(LlamaForCausalLM.from_pretrained(back)(x).logits, ref, rtol=0, atol=1e-5)
    text = "the cat sat in the park"
    want = AutoTokenizer.from_pretrained(src)(text).input_ids
    assert AutoTokenizer.from_pretrained(ckpt)(text).input_ids == want
    assert AutoTokenizer.from_pretrained(back)(text).input_ids == want
    assert json.loads((ckpt / "config.json").read_text())["eos_token_id"] == 2
    assert not list(tmp_path.glob(".stem.tmp-*"))


@pytest.mark.parametrize("kind", ["stem", "stem_dagger", "stem_gate"])
def test_project_init_is_embedding_through_replaced_projection(kind):
    llama = tiny_llama()
    stem = llama_to_stem(llama, ffn=kind, stem_layers="1/2", init="project")
    assert stem.cfg.table_layers == (1,)
    mlp, emb = llama.model.layers[1].mlp, llama.model.embed_tokens.weight
    source = mlp.gate_proj.weight if kind == "stem_gate" else mlp.up_proj.weight
    torch.testing.assert_close(stem.tables["1"].weight, emb @ source.T, rtol=0, atol=0)  # (V, d_ff)
    ffn = stem.layers[1].ffn
    assert torch.equal(ffn.w_down.weight, mlp.down_proj.weight)
    if kind == "stem_dagger":
        assert torch.equal(ffn.w_up.weight, mlp.up_proj.weight)
    if kind == "stem_gate":
        assert torch.equal(ffn.w_up.weight, mlp.up_proj.weight) and not hasattr(ffn, "w_gate")
    else:
        assert torch.equal(ffn.w_gate.weight, mlp.gate_proj.weight)


def test_stem_conversion_keeps_earlier_layers_exact():
    llama = tiny_llama()
    stem = llama_to_stem(llama, ffn="stem", stem_layers="2", init="random", seed=3)
    seen = {}

    def grab(name):
        def hook(module, args, kwargs):
            seen[name] = (args[0] if args else kwargs["hidden_states"]).detach().clone()
        return hook

    stem.layers[2].register_forward_pre_hook(grab("stem"), with_kwargs=True)
    llama.model.layers[2].register_forward_pre_hook(grab("llama"), with_kwargs=True)
    x = ids()
    with torch.no_grad():
        llama(x)
        stem(x)
    torch.testing.assert_close(seen["stem"], seen["llama"], rtol=0, atol=1e-5)  # input of the STEM layer
    llama_state = llama.state_dict()
    for name, t in stem.state_dict().items():
        if name.startswith(("layers.0.", "layers.1.", "layers.2.attn")) or name == "norm.weight":
            assert torch.equal(t, llama_state[llama_name(name)]), name


def test_random_tables_follow_seed():
    llama = tiny_llama()
    a, b, c = (llama_to_stem(llama, ffn="stem", stem_layers="1/3", init="random", seed=s) for s in (5, 5, 6))
    (layer,) = a.cfg.table_layers
    assert torch.equal(a.tables[str(layer)].weight, b.tables[str(layer)].weight)
    assert not torch.equal(a.tables[str(layer)].weight, c.tables[str(layer)].weight)


# -- Auto classes, save/load, generate ---------------------------------------------------------
def test_stem_config_mirrors_model_config():
    hf_fields = {f.name: f.default for f in dataclasses.fields(StemConfig)}
    for f in dataclasses.fields(ModelConfig):
        if f.init:
            assert f.name in hf_fields and hf_fields[f.name] == f.default, f.name
    cfg = model_config("debug", ffn="stem_dagger", stem_layers=[1, 3])
    assert StemConfig.from_model_config(cfg).model_config() == cfg


@pytest.mark.parametrize("kind, tie", [("dense", True), ("stem", False), ("stem_gate", True), ("hash_moe", False)])
def test_auto_model_loads_stemlm_checkpoint(tmp_path, kind, tie):
    model = StemLM(model_config("debug", ffn=kind, stem_layers="1/2", tie_embeddings=tie)).eval()
    save_model(model, tmp_path / "c")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "c")
    assert isinstance(hf, StemForCausalLM)
    x = torch.randint(0, 512, (2, 10))
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, open_model(tmp_path / "c")(x), rtol=0, atol=0)
    hf.save_pretrained(tmp_path / "h")  # and the HF side writes what checkpoint.load_model reads
    with torch.no_grad():
        torch.testing.assert_close(open_model(tmp_path / "h")(x), model(x), rtol=0, atol=0)
    assert (hf.model.lm_head.weight is hf.model.tok_embeddings.weight) == tie


@pytest.mark.parametrize("tables, extra", [("host", {"cache_rows": 8}), ("disk", {}), ("device", {"table_dtype": "bf16"})])
def test_auto_model_takes_a_table_placement(tmp_path, tables, extra):
    from stemlm.model.quant import quantize_tables
    from stemlm.store import TableStore

    model = StemLM(model_config("debug", ffn="stem", stem_layers="1/2")).eval()
    save_model(model, tmp_path / "c")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "c", tables=tables, **extra)
    assert isinstance(hf, StemForCausalLM) and not hf.training
    assert isinstance(hf.model.tables, TableStore) == (tables != "device")
    if "table_dtype" in extra:
        quantize_tables(model, extra["table_dtype"])
    x = torch.randint(0, 512, (2, 10))
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, model(x), rtol=0, atol=1e-6)
    prompt = x[:1, :4]
    assert torch.equal(hf.generate(prompt, max_new_tokens=4, do_sample=False, min_new_tokens=4),
                       _greedy_by_hand(model, prompt, 4))
    hf.model.tables.close()


def _greedy_by_hand(model: StemLM, prompt: torch.Tensor, steps: int) -> torch.Tensor:
    seq = prompt
    for _ in range(steps):
        nxt = model(seq)[:, -1].argmax(-1, keepdim=True)  # full forward every step, no cache
        seq = torch.cat([seq, nxt], dim=1)
    return seq


def test_generate_with_cache_equals_no_cache_and_manual_loop(tmp_path):
    model = StemLM(model_config("debug", ffn="stem", stem_layers="1/2")).eval()
    save_model(model, tmp_path / "c")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "c")
    prompt = torch.randint(0, 512, (2, 6))
    kw = dict(max_new_tokens=8, do_sample=False, min_new_tokens=8)
    cached = hf.generate(prompt, **kw)
    uncached = hf.generate(prompt, use_cache=False, **kw)
    with torch.no_grad():
        manual = _greedy_by_hand(model, prompt, 8)
    assert torch.equal(cached, uncached) and torch.equal(cached, manual)


@pytest.mark.parametrize("name", ["cache", "past_key_values"])
def test_cache_argument_under_either_name_continues_the_sequence(name):
    """transformers >= 5.24 passes the cache as `cache`, older 5.x as `past_key_values`."""
    from transformers import DynamicCache

    hf = StemForCausalLM(StemConfig.from_model_config(model_config("debug", ffn="stem"))).eval()
    x = torch.randint(0, 512, (2, 9))
    with torch.no_grad():
        full = hf(x).logits
        kv = DynamicCache(config=hf.config)
        first = hf(x[:, :6], **{name: kv})
        out_cache = first.cache if hasattr(first, "cache") else first.past_key_values
        assert out_cache is kv and kv.get_seq_length() == 6
        rest = hf(x[:, 6:], **{name: kv}).logits
    torch.testing.assert_close(torch.cat([first.logits, rest], dim=1), full, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="not both"):
        hf(x, cache=DynamicCache(config=hf.config), past_key_values=DynamicCache(config=hf.config))


def test_labels_give_the_shifted_cross_entropy(tmp_path):
    hf = StemForCausalLM(StemConfig.from_model_config(model_config("debug")))
    x = torch.randint(0, 512, (2, 9))
    out = hf(x, labels=x)
    ref = torch.nn.functional.cross_entropy(out.logits[:, :-1].reshape(-1, 512), x[:, 1:].reshape(-1))
    torch.testing.assert_close(out.loss, ref)


def test_padding_rules():
    hf = StemForCausalLM(StemConfig.from_model_config(model_config("debug"))).eval()
    x = torch.randint(0, 512, (2, 7))
    right = torch.ones_like(x)
    right[1, 5:] = 0
    with torch.no_grad():
        torch.testing.assert_close(hf(x, attention_mask=right).logits[1, :5], hf(x[1:, :5]).logits[0], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="attention_mask must have shape"):
        hf(x, attention_mask=right[:, 1:])
    with pytest.raises(ValueError, match="inputs_embeds"):
        hf(inputs_embeds=torch.randn(1, 3, 64))


def test_left_padded_batch_generate_equals_each_prompt_alone():
    torch.manual_seed(0)
    hf = StemForCausalLM(StemConfig.from_model_config(model_config("debug", ffn="stem", stem_layers="1/2"),
                                                      pad_token_id=0)).eval()
    prompts = [torch.randint(3, 512, (n,)).tolist() for n in (3, 8, 5)]
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    kw = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False)
    batched = hf.generate(input_ids=ids, attention_mask=mask, **kw)[:, width:]
    for row, p in zip(batched, prompts):
        assert row.tolist() == hf.generate(torch.tensor([p]), **kw)[0, len(p):].tolist()


def test_left_padded_batch_with_a_tokenizer(tmp_path):
    tok = tiny_tokenizer()
    tok.pad_token = tok.eos_token
    cfg = model_config("debug", ffn="stem", stem_layers="1/2", vocab_size=len(tok))
    hf = StemForCausalLM(StemConfig.from_model_config(cfg, pad_token_id=tok.pad_token_id)).eval()
    texts = ["the cat", "a dog ran in the park", "stem tables hold"]
    batch = tok(texts, padding=True, padding_side="left", return_tensors="pt")
    kw = dict(max_new_tokens=5, min_new_tokens=5, do_sample=False)
    out = hf.generate(**batch, **kw)[:, batch["input_ids"].shape[1]:]
    for row, text in zip(out, texts):
        alone = tok(text, return_tensors="pt")
        assert row.tolist() == hf.generate(**alone, **kw)[0, alone["input_ids"].shape[1]:].tolist()


# -- errors ------------------------------------------------------------------------------------
def test_export_of_stem_model_is_refused(tmp_path):
    save_model(StemLM(model_config("debug", ffn="stem", stem_layers="1/3")), tmp_path / "s")
    with pytest.raises(ValueError, match="only an all-dense"):
        convert_to_hf(tmp_path / "s", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_corrupt_checkpoint_is_a_clear_error(tmp_path):
    save_model(StemLM(model_config("debug", ffn="dense")), tmp_path / "d")
    (tmp_path / "d" / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError, match="corrupt"):
        convert_to_hf(tmp_path / "d", tmp_path / "out")
    _, src = llama_dir(tmp_path, tokenizer=False)
    (src / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="cannot load the Llama checkpoint"):
        convert_from_hf(src, tmp_path / "out")


def test_vocab_mismatch_and_missing_files(tmp_path):
    _, src = llama_dir(tmp_path, extra_tokens=V)  # tokenizer larger than the model's vocabulary
    with pytest.raises(ValueError, match="tokenizer has .* model vocabulary has 128"):
        convert_from_hf(src, tmp_path / "out")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        convert_from_hf(tmp_path / "empty", tmp_path / "out")
    with pytest.raises(FileNotFoundError, match="GGUF"):
        convert_from_hf(tmp_path / "empty", tmp_path / "out", gguf_file="nope.gguf")
    (tmp_path / "empty" / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="no weights"):
        convert_from_hf(tmp_path / "empty", tmp_path / "out")


def test_bad_llama_inputs_are_refused():
    llama = tiny_llama()
    state = dict(llama.state_dict())
    state["model.layers.1.mlp.up_proj.weight"] = torch.zeros(97, 64)
    with pytest.raises(ValueError, match=r"up_proj.weight' has shape \(97, 64\)"):
        llama_to_stem(state, llama.config)
    with pytest.raises(ValueError, match="attention_bias"):
        llama_to_stem(tiny_llama(attention_bias=True))
    with pytest.raises(ValueError, match="not supported for conversion"):
        llama_to_stem(llama, ffn="hash_moe")
    with pytest.raises(ValueError, match="rope_type 'linear'"):
        llama_to_stem(tiny_llama(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}))


def test_cli_converts_both_ways_and_reports_errors(tmp_path, capsys):
    llama, src = llama_dir(tmp_path)
    assert main(["convert", "--from-hf", str(src), "--out", str(tmp_path / "s"), "--ffn", "stem",
                 "--stem-layers", "1", "--init", "random", "--seed", "1"]) == 0
    assert open_model(tmp_path / "s").cfg.table_layers == (1,)
    assert main(["convert", "--to-hf", "--ckpt", str(tmp_path / "s"), "--out", str(tmp_path / "x")]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]  # after transformers' progress bars
    assert last.startswith("stemlm convert: error: model has stem layers [1]; only an all-dense")
    assert main(["convert", "--from-hf", str(src), "--out", str(tmp_path / "d")]) == 0
    assert main(["convert", "--to-hf", "--ckpt", str(tmp_path / "d"), "--out", str(tmp_path / "l")]) == 0
    x = ids()
    with torch.no_grad():
        torch.testing.assert_close(LlamaForCausalLM.from_pretrained(tmp_path / "l")(x).logits, llama(x).logits,
                                   rtol=0, atol=1e-5)


def test_auto_model_computes_with_onednn_and_switches_back(tmp_path):
    from stemlm.runtime.matmul import OneDNNLinear, onednn_available, use_matmul_backend

    model = StemLM(model_config("debug", ffn="stem", stem_layers="1/2")).eval()
    save_model(model, tmp_path / "c")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "c")
    linears = [m for m in hf.modules() if isinstance(m, nn.Linear)]
    assert linears and all(type(m) is (OneDNNLinear if onednn_available() else nn.Linear) for m in linears)
    prompt = torch.randint(0, 512, (2, 6))
    kw = dict(max_new_tokens=6, do_sample=False, min_new_tokens=6)
    with torch.no_grad():
        fast_logits, fast = hf(prompt).logits, hf.generate(prompt, **kw)
        use_matmul_backend(hf, "aten")
        assert all(type(m) is nn.Linear for m in hf.modules() if isinstance(m, nn.Linear))
        torch.testing.assert_close(hf(prompt).logits, fast_logits, rtol=0, atol=1e-5)
        assert torch.equal(hf.generate(prompt, **kw), fast)
