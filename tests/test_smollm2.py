"""The real SmolLM2-135M-Instruct (pinned GGUF, dequantised by transformers) converted to stemlm.

Slow (loads the GGUF twice, ~30 s each on 2 cores; the STEM conversion writes ~3.4 GB of tables):
run with ``pytest -m slow tests/test_smollm2.py -s`` to see timings and differences.
"""

import time

import pytest
import torch

from stemlm.store import open_model
from stemlm.cli import main
from stemlm.data.codec import load_codec
from stemlm.interop.convert import llama_name, llama_to_stem, load_llama, resolve_source
from kv_helpers import KVCache

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at a temperature of"]
LOGIT_TOL = 1e-4


@pytest.fixture(scope="module")
def smollm2():
    """(LlamaForCausalLM in fp32, tokenizer) from the pinned GGUF."""
    t0 = time.perf_counter()
    directory, gguf = resolve_source("smollm2")
    tokenizer = load_codec(tokenizer=directory, prefer="transformers", gguf_file=gguf).tokenizer
    llama = load_llama(directory, gguf)
    print(f"\nGGUF -> transformers LlamaForCausalLM: {time.perf_counter() - t0:.1f} s")
    return llama, tokenizer


@torch.no_grad()
def greedy(model, ids: torch.Tensor, steps: int) -> torch.Tensor:
    """stemlm's own loop: prefill into a KVCache, then one token per step."""
    cache = KVCache(model.cfg, batch_size=ids.shape[0], max_len=ids.shape[1] + steps)
    logits = model(ids, start_pos=0, cache=cache)[:, -1]
    out = []
    for pos in range(ids.shape[1], ids.shape[1] + steps):
        out.append(logits.argmax(-1, keepdim=True))  # (B, 1)
        logits = model(out[-1], start_pos=pos, cache=cache)[:, -1]
    return torch.cat(out, dim=1)


def test_dense_conversion_matches_transformers_and_says_paris(smollm2):
    llama, tokenizer = smollm2
    t0 = time.perf_counter()
    stem = llama_to_stem(llama)
    print(f"llama_to_stem (dense): {time.perf_counter() - t0:.2f} s, config {stem.cfg}")
    worst = 0.0
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = tokenizer(prompt, return_tensors="pt").input_ids
            diff = (llama(ids).logits - stem(ids)).abs().max().item()
            worst = max(worst, diff)
            print(f"  {prompt!r}: {ids.shape[1]} tokens, max |logit diff| = {diff:.3g}")
    print(f"max abs logit difference over prompts: {worst:.3g} (tolerance {LOGIT_TOL})")
    assert worst <= LOGIT_TOL
    ids = tokenizer(PROMPTS[0], return_tensors="pt").input_ids
    t0 = time.perf_counter()
    new = greedy(stem, ids, 8)
    seconds = time.perf_counter() - t0
    text = tokenizer.decode(new[0])
    hf_new = llama.generate(ids, max_new_tokens=8, do_sample=False)[:, ids.shape[1]:]
    print(f"stemlm greedy, 8 tokens with KVCache ({seconds:.2f} s): {PROMPTS[0]!r} -> {text!r}; "
          f"transformers generate: {tokenizer.decode(hf_new[0])!r}")
    assert text.startswith(" Paris")
    assert torch.equal(new, hf_new)


def test_stem_conversion_through_the_cli(smollm2, tmp_path):
    llama, tokenizer = smollm2
    t0 = time.perf_counter()
    assert main(["convert", "--from-hf", "smollm2", "--out", str(tmp_path / "stem"), "--ffn", "stem",
                 "--stem-layers", "1/3", "--init", "project"]) == 0
    print(f"\nstemlm convert --ffn stem --stem-layers 1/3 --init project: {time.perf_counter() - t0:.1f} s")
    t0 = time.perf_counter()
    stem = open_model(tmp_path / "stem")
    print(f"load_model: {time.perf_counter() - t0:.1f} s; STEM layers {stem.cfg.stem_layer_ids}")
    assert stem.cfg.stem_layer_ids == tuple(range(2, 30, 3))
    first = stem.cfg.stem_layer_ids[0]
    llama_state = llama.state_dict()
    for name, t in stem.state_dict().items():
        if name.startswith("tables."):
            continue
        layer = int(name.split(".")[1]) if name.startswith("layers.") else None
        if layer is None or stem.cfg.layer_kinds[layer] == "dense" or ".attn" in name or "_norm" in name:
            assert torch.equal(t, llama_state[llama_name(name)]), name
    seen = {}
    stem.layers[first].register_forward_pre_hook(lambda m, a: seen.__setitem__("stem", a[0].clone()))
    handle = llama.model.layers[first].register_forward_pre_hook(
        lambda m, a, k: seen.__setitem__("llama", (a[0] if a else k["hidden_states"]).clone()), with_kwargs=True)
    ids = tokenizer(PROMPTS[0], return_tensors="pt").input_ids
    with torch.no_grad():
        logits = stem(ids)
        llama(ids)
    handle.remove()
    diff = (seen["stem"] - seen["llama"]).abs().max().item()
    print(f"input of layer {first} (first STEM layer): max |diff| = {diff:.3g}; "
          f"STEM greedy: {tokenizer.decode(greedy(stem, ids, 8)[0])!r}")
    assert torch.isfinite(logits).all() and diff <= LOGIT_TOL
    assert tokenizer(PROMPTS[0]).input_ids == load_codec(tokenizer=tmp_path / "stem", prefer="transformers").tokenizer(PROMPTS[0]).input_ids
