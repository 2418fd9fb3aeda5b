"""``decode_benchmark``: decode tokens/s of a model as it stands, for benchmark scripts (CPU or GPU).

It runs the one decode core (``core.DecodeCore``) the way ``generate`` and the server do: random
prompts of ``prompt_len`` tokens, greedy, ``new_tokens`` tokens each, no end-of-text. Where the
tables live (device, host, disk) is the model's business: offload them first
(``stemlm.store.offload_tables``) to measure a tier. The first run warms up (and, with
``graphs`` on CUDA, captures the step's graph for the batch's bucket); the timed runs follow.
"""

from __future__ import annotations

import statistics
import time

import torch

from .core import DecodeCore, Generation
from .sampling import SamplingParams


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _run(core: DecodeCore, prompts: list[list[int]], new_tokens: int) -> tuple[float, float, list[list[int]]]:
    """One generation: ``(prefill seconds, decode seconds, tokens of every prompt)``."""
    seqs = [Generation(p, SamplingParams(new_tokens)) for p in prompts]
    _sync(core.device)
    t0 = time.perf_counter()
    core.add(seqs)
    _sync(core.device)
    t1 = time.perf_counter()
    while core.running:
        core.step()
    _sync(core.device)
    return t1 - t0, time.perf_counter() - t1, [s.tokens for s in seqs]


@torch.no_grad()
def decode_benchmark(model, batch: int = 1, new_tokens: int = 100, prompt_len: int = 16, graphs: str = "auto",
                     repeats: int = 3, seed: int = 0, store="auto") -> dict:
    """Decode speed of ``model`` at ``batch`` rows: a JSON-ready dict.

    ``decode_tokens_per_s`` counts the tokens after the first (which comes out of the prefill) over
    the time from the end of the prefill to the last token, median over ``repeats`` timed runs after one
    warm-up run (``warmup_s``, which includes graph capture). ``graphs``: ``auto``/``on``/``off``/``static``
    (``core.DecodeCore``); ``mode`` in the result is what ran. ``tokens`` are the first prompt's new
    tokens, to check that two settings decode alike.
    """
    if batch < 1 or new_tokens < 2 or prompt_len < 1 or repeats < 1:
        raise ValueError(f"need batch >= 1, new_tokens >= 2, prompt_len >= 1, repeats >= 1; got {batch}, "
                         f"{new_tokens}, {prompt_len}, {repeats}")
    cfg = model.cfg
    if prompt_len + new_tokens > cfg.max_seq_len:
        raise ValueError(f"prompt_len + new_tokens = {prompt_len + new_tokens} exceeds max_seq_len={cfg.max_seq_len}")
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, cfg.vocab_size, (batch, prompt_len), generator=g).tolist()
    core = DecodeCore(model, store=store, max_rows=batch, max_len=prompt_len + new_tokens, graphs=graphs)
    t0 = time.perf_counter()
    _run(core, prompts, new_tokens)
    warmup = time.perf_counter() - t0
    runs = [_run(core, prompts, new_tokens) for _ in range(repeats)]
    decode = [d for _, d, _ in runs]
    steps = new_tokens - 1
    return {"batch": batch, "new_tokens": new_tokens, "prompt_len": prompt_len, "graphs": graphs, "mode": core.mode,
            "device": str(core.device), "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
            "tables": model.tables.tier,
            "decode_tokens_per_s": batch * steps / statistics.median(decode),
            "step_ms": 1000 * statistics.median(decode) / steps, "decode_s": decode,
            "prefill_s": [p for p, _, _ in runs], "warmup_s": warmup, "tokens": runs[-1][2][0]}
