"""Autoregressive generation of a batch of equal-length prompts, one step at a time.

``generate`` yields the new tokens ``(B,)`` step by step; ``generate_ids`` collects them. Both run
on the one decode core (``core.DecodeCore``): the prompt is prefilled into the KV cache, then each
step feeds the last token and samples the next; right after sampling, the model's tables
(``model.tables``, a no-op in memory) are asked to prefetch the rows of the next token, so the gather
overlaps with the rest of the step's Python and attention work. The rows of a batch share one seeded
generator and draw from it in row order. ``sample`` and the other sampling helpers live in
``sampling`` (re-exported here).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from .core import DecodeCore, Generation
from .sampling import SamplingParams, check_sampling, draw, new_generator, sample, sampling_probs  # noqa: F401


def generate(model, prompt: torch.Tensor, max_new_tokens: int, temperature: float = 0.0, top_k: int | None = None,
             top_p: float | None = None, seed: int | None = None, eos_id: int | None = None,
             store="auto", graphs: str = "auto") -> Iterator[torch.Tensor]:
    """Yield the new tokens ``(B,)`` one step at a time.

    Stops after ``max_new_tokens``, when every row has produced ``eos_id``, or at the model's
    ``max_seq_len``. ``store="auto"`` prefetches through the model's tables (``model.tables``); pass
    ``None`` to disable prefetch. ``graphs`` picks the decode step (``core.DecodeCore``: ``auto``
    captures CUDA graphs on CUDA, ``off`` runs eagerly, ``static`` runs the static shapes without
    capture). Same seed, same tokens. The arguments are checked when ``generate`` is called, before
    the first token is asked for.
    """
    if prompt.dim() != 2 or prompt.shape[1] == 0:
        raise ValueError(f"prompt must have shape (batch, seq) with seq >= 1, got {tuple(prompt.shape)}")
    if prompt.shape[1] > model.cfg.max_seq_len:
        raise ValueError(f"prompt of {prompt.shape[1]} tokens exceeds max_seq_len={model.cfg.max_seq_len}")
    check_sampling(temperature, top_k, top_p)
    T = prompt.shape[1]
    n_new = min(max_new_tokens, model.cfg.max_seq_len - T + 1)  # the last sampled token is never fed back
    core = DecodeCore(model, store=store, max_rows=prompt.shape[0], max_len=T + max(n_new, 1) - 1, graphs=graphs)
    return _generate(core, prompt, n_new, SamplingParams(max(n_new, 0), temperature, top_k, top_p), seed, eos_id)


def _generate(core: DecodeCore, prompt, n_new, params, seed, eos_id) -> Iterator[torch.Tensor]:
    if n_new <= 0:
        return
    shared = new_generator(seed, prompt.device)
    seqs = [Generation(row, params, generator=shared) for row in prompt.tolist()]
    finished = torch.zeros(prompt.shape[0], dtype=torch.bool, device=prompt.device)
    core.add(seqs)
    for step in range(n_new):
        token = torch.tensor([s.tokens[-1] for s in seqs], device=prompt.device)  # (B,)
        if eos_id is not None:
            finished |= token == eos_id
        yield token
        if step == n_new - 1 or (eos_id is not None and bool(finished.all())):
            return
        core.step()


def generate_ids(model, prompt: torch.Tensor, max_new_tokens: int, **kwargs) -> torch.Tensor:
    """Prompt plus all generated tokens ``(B, T + N)`` (collects ``generate``)."""
    new = list(generate(model, prompt, max_new_tokens, **kwargs))
    return torch.cat([prompt, torch.stack(new, dim=1)], dim=1) if new else prompt.clone()
