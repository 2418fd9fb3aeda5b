"""The running batch of the server: rows join between decode steps and leave when they finish.

``decode_batch`` fixes its rows at the start. Here a group of newcomers is prefilled on its own
(left-padded, as ``decode_batch`` does) and its KV cache is merged into the running batch's: both
are cut to their real slots (leading slots that are padding in every row of a part are dropped)
and right-aligned in one new cache, so every row keeps its keys at the same distance from the next
slot and its own positions (``slot - pad``)::

    running  (2 rows, 5 slots)   p a a a a | next        newcomers (W=3)   b b b | next
                                 c c c c c |                               p d d |
    merged   (4 rows, 5 slots)   p a a a a | next  <- all rows feed their next token at slot 5
                                 c c c c c |
                                 p p b b b |
                                 p p p d d |

Padding slots are hidden by ``padding_mask``, so each row computes what it computes alone.
"""

from __future__ import annotations

import torch

from ..inference.batch_generate import left_pad, padding_mask
from ..inference.generate import decode_one_token
from ..inference.kv_cache import KVCache


class RunningBatch:
    """Rows decoded together: one left-padded ``KVCache``, each row's padding and the filled width."""

    def __init__(self, model, pad_id: int = 0, store=None):
        self.model, self.pad_id, self.store = model, pad_id, store
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.cache: KVCache | None = None
        self.pad = torch.zeros(0, dtype=torch.long, device=self.device)  # (B,)
        self.width = 0  # slots written so far; the next token of every row goes to slot ``width``

    def __len__(self) -> int:
        return int(self.pad.numel())

    @torch.no_grad()
    def prefill(self, prompts: list[list[int]]) -> tuple[tuple[KVCache, torch.Tensor, int], torch.Tensor]:
        """Run newcomers' prompts as one left-padded group; ``(group, logits (n, W, V))``.

        The group (its cache, padding and width) joins the batch with ``join``."""
        ids, pad, positions, mask = left_pad(prompts, self.pad_id, self.device)
        cache = KVCache(self.model.cfg, len(prompts), max_len=ids.shape[1], device=self.device, dtype=self.dtype)
        if self.store is not None:
            self.store.prefetch(ids)
        logits = self.model(ids, start_pos=0, cache=cache, positions=positions, attn_mask=mask)  # (n, W, V)
        return (cache, pad, ids.shape[1]), logits

    def join(self, group: tuple[KVCache, torch.Tensor, int], room: int) -> None:
        """Append a prefilled group's rows after the current ones; ``room`` free slots follow the merged width."""
        parts = [(self.cache, self.pad, self.width)] if len(self) else []
        parts.append(group)
        cuts = [int(pad.min()) for _, pad, _ in parts]  # leading slots that are padding in every row of a part
        width = max(w - c for (_, _, w), c in zip(parts, cuts))
        rows = sum(int(pad.numel()) for _, pad, _ in parts)
        merged = KVCache(self.model.cfg, rows, max_len=width + room, device=self.device, dtype=self.dtype)
        pads, r = [], 0
        for (cache, pad, w), cut in zip(parts, cuts):
            n, shift = int(pad.numel()), width - (w - cut)  # this part's rows move right by ``shift`` slots
            for dst, src in ((merged.k, cache.k), (merged.v, cache.v)):
                for layer in range(len(dst)):
                    dst[layer][r:r + n, :, shift:width] = src[layer][:, :, cut:w]  # (n, nkv, w - cut, hd)
            pads.append(pad - cut + shift)
            r += n
        self.cache, self.pad, self.width = merged, torch.cat(pads), width

    def keep(self, rows: list[int]) -> None:
        """Keep only the batch rows ``rows`` (in that order); the others leave the batch and its cache."""
        if len(rows) == len(self):
            return
        if not rows:
            self.cache, self.pad, self.width = None, self.pad[:0], 0
            return
        kept = torch.tensor(rows, device=self.device)
        self.cache.keep_rows(kept)
        self.pad = self.pad[kept]

    @torch.no_grad()
    def step(self, tokens: list[int]) -> torch.Tensor:
        """Feed each row its last token at slot ``width``; the next logits ``(B, V)``."""
        slot = self.width
        token = torch.tensor(tokens, dtype=torch.long, device=self.device)[:, None]  # (B, 1)
        real = torch.arange(slot + 1, device=self.device)[None, :] >= self.pad[:, None]  # (B, S)
        logits = decode_one_token(self.model, token, slot, self.cache, positions=(slot - self.pad)[:, None],
                                  attn_mask=padding_mask(real, slot, 1))
        self.width += 1
        return logits
