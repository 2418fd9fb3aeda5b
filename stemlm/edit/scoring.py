"""Batched teacher-forced scoring of (prompt, answer) pairs.

Sequences are right-padded into one batch; with causal attention the padding after a
sequence cannot change its logits, so every sequence is scored as if alone. The same list
scored twice gives bitwise-equal logits (same batches, same kernels), which is what the
reversibility check relies on.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class Scores:
    """Per sequence: next-token logits after the prompt, and whether the answer is predicted.

    * ``last_logits (N, V)``: logits at the last prompt position (fp32);
    * ``first_ok (N,)``: the answer's first token is the top-1 next token;
    * ``full_ok (N,)``: every answer token is top-1 given the gold prefix (= greedy decoding
      reproduces the whole answer);
    * ``logprob (N,)``: log-probability of the full answer.
    """

    last_logits: torch.Tensor
    first_ok: torch.Tensor
    full_ok: torch.Tensor
    logprob: torch.Tensor

    def probs(self) -> torch.Tensor:
        """Next-token distributions ``(N, V)``."""
        return torch.softmax(self.last_logits, dim=-1)


@torch.no_grad()
def score(model, prompts: Sequence[Sequence[int]], answers: Sequence[Sequence[int]], batch_size: int = 64) -> Scores:
    """Score ``prompt + answer`` for every pair (see ``Scores``)."""
    if len(prompts) != len(answers):
        raise ValueError(f"{len(prompts)} prompts but {len(answers)} answers")
    device = next(model.parameters()).device
    last, first, full, logp = [], [], [], []
    for start in range(0, len(prompts), batch_size):
        ps, ans = prompts[start:start + batch_size], answers[start:start + batch_size]
        seqs = [list(p) + list(a) for p, a in zip(ps, ans)]
        batch = torch.zeros(len(seqs), max(len(s) for s in seqs), dtype=torch.long)  # right padding, id 0
        for i, s in enumerate(seqs):
            batch[i, :len(s)] = torch.tensor(s)
        logits = model(batch.to(device)).float().cpu()  # (b, T, V)
        # every (row, position) that predicts an answer token, flattened: (K,)
        rows = torch.cat([torch.full((len(a),), i) for i, a in enumerate(ans)])
        pos = torch.cat([torch.arange(len(p) - 1, len(p) - 1 + len(a)) for p, a in zip(ps, ans)])
        target = torch.cat([torch.tensor(list(a)) for a in ans])
        step = logits[rows, pos]  # (K, V)
        hit = step.argmax(-1) == target
        tok_logp = torch.log_softmax(step, -1).gather(1, target[:, None])[:, 0]
        offsets = [0]
        for a in ans:
            offsets.append(offsets[-1] + len(a))
        for i, p in enumerate(ps):
            lo, hi = offsets[i], offsets[i + 1]
            last.append(logits[i, len(p) - 1])
            first.append(bool(hit[lo]))
            full.append(bool(hit[lo:hi].all()))
            logp.append(float(tok_logp[lo:hi].sum()))
    if not last:
        return Scores(torch.zeros(0, 0), torch.zeros(0, dtype=torch.bool), torch.zeros(0, dtype=torch.bool), torch.zeros(0))
    return Scores(torch.stack(last), torch.tensor(first), torch.tensor(full), torch.tensor(logp))


def kl_divergence(p_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    """``KL(p || q)`` per row of two logit matrices ``(N, V)``, in nats."""
    lp, lq = torch.log_softmax(p_logits, -1), torch.log_softmax(q_logits, -1)
    return (lp.exp() * (lp - lq)).sum(-1)
