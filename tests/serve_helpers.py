"""Shared by tests/test_serve*.py: a tiny checkpoint with its tokenizer, and reference decoding."""

from pathlib import Path

import torch

from stemlm import StemLM, model_config
from stemlm.inference.batch_generate import SamplingParams, generate_batch
from stemlm.checkpoint.directory import save_model
from stemlm.data.tokenizer import train_bpe

TEXTS = ["The capital of France is Paris. The capital of Spain is Madrid. Once upon a time there was a cat."] * 40
CHAT_TEMPLATE = ("{% for m in messages %}<|pad|>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|pad|>assistant:{% endif %}")


def tiny_checkpoint(path: Path, max_seq_len: int = 512, seed: int = 0) -> Path:
    """A debug STEM model (tables in half the layers) whose vocabulary is its tokenizer's, saved at ``path``."""
    tok = train_bpe(TEXTS, vocab_size=300)
    torch.manual_seed(seed)
    cfg = model_config("debug", ffn="stem", stem_layers="1/2", vocab_size=tok.get_vocab_size(), max_seq_len=max_seq_len)
    save_model(StemLM(cfg).eval(), path)
    tok.save(str(path / "tokenizer.json"))
    return path


def alone(model, prompt: list[int], params: SamplingParams, eos_id: int | None) -> list[int]:
    """The tokens ``generate_batch`` gives ``prompt`` decoded on its own."""
    return generate_batch(model, [prompt], params, eos_id=eos_id)[0]
