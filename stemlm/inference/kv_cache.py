"""The decode core's key/value cache, ``SlotCache``: every row at its own position, rows join and leave.

``StemLM.forward`` takes as its ``cache`` any object with an ``update(layer_idx, k, v, start_pos)`` method and a
``splits_attention`` flag (the Hugging Face wrapper adapts ``DynamicCache`` this way; the tests keep a plain
one): while the flag is true, a layer's attention is the cache's ``attend(layer_idx, q, k, v)`` instead (a
decode step with a prefill merged into it, ``SlotCache.mixed``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..config import ModelConfig


def ragged_mask(slots: torch.Tensor, pos: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The attention mask of a ragged decode step: row ``j`` (at position ``pos[j]``, ``pos (n,)``) sees the
    cache ``slots (S,)`` up to its own and none past it; additive (0 / -inf in ``dtype``) ``(n, 1, 1, S)``,
    built once for every layer (a boolean mask is converted again by each layer's attention: +0.3 ms of
    a 6.7 ms step on 2 CPU cores at the tiny shape, batch 16). No host sync: a CUDA graph can record it."""
    hidden = slots[None, :] > pos[:, None]  # (n, S): slots past a row's own
    return torch.zeros(hidden.shape, dtype=dtype, device=pos.device).masked_fill_(hidden, float("-inf"))[:, None, None]


class SlotCache:
    """The KV cache of a running batch: row ``r`` holds its sequence's keys at slots ``0..len-1``, so
    slot = position and no row carries padding. Rows join and leave without moving the others' keys.

    A forward writes through one of three views, set before it (``StemLM.forward`` calls ``update``):

    * ``uniform(n, span)``: rows ``0..n-1`` all write at ``start_pos`` (one cache position for all rows);
    * ``ragged(slots, span)``: row ``j`` writes its one new token at ``slots[j]`` (its own position),
      keys ``0..span-1`` are returned and a mask hides each row's slots past its own;
    * ``prefill(rows)``: a group's right-padded prompts go to cache rows ``rows`` at slots ``0..W-1``;
      the group attends only to itself, so its own keys are returned;
    * ``packed(rows, places, lengths, width)``: the same for prompts packed several to a row;
    * ``mixed(...)``: a ragged decode step and a packed prefill in one forward, attention run per part
      (``attend``).

    ``span`` and the number of rows are Python ints (no host sync); the static decode step passes the
    full ``max_len`` and a bucket of rows, so its shapes never change (``stemlm.inference.static``).
    Buffers grow (``reserve``) unless ``fixed``: a captured CUDA graph needs fixed addresses.
    """

    def __init__(self, cfg: ModelConfig, rows: int, max_len: int, device=None, dtype: torch.dtype = torch.float32,
                 fixed: bool = False):
        self.cfg, self.device, self.dtype, self.fixed = cfg, device, dtype, fixed
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.rows = self.max_len = 0
        self._alloc(rows, max_len)
        self._view: tuple = ("uniform", 0, 0)

    def _alloc(self, rows: int, max_len: int) -> None:
        shape = (rows, self.cfg.n_kv_heads, max_len, self.cfg.head_dim)
        new_k = [torch.zeros(shape, device=self.device, dtype=self.dtype) for _ in range(self.cfg.n_layers)]
        new_v = [torch.zeros(shape, device=self.device, dtype=self.dtype) for _ in range(self.cfg.n_layers)]
        for old, new in ((self.k, new_k), (self.v, new_v)):
            for a, b in zip(old, new):
                b[:self.rows, :, :self.max_len] = a
        self.k, self.v, self.rows, self.max_len = new_k, new_v, rows, max_len

    def reserve(self, rows: int, length: int) -> None:
        """Make room for ``rows`` rows of ``length`` slots (growing by doubling, up to what is asked)."""
        if rows <= self.rows and length <= self.max_len:
            return
        if self.fixed:
            raise ValueError(f"the static KV cache holds {self.rows} rows of {self.max_len} slots; "
                             f"{rows} rows of {length} slots were asked for")
        self._alloc(max(rows, self.rows), max(length, min(2 * self.max_len, self.cfg.max_seq_len)))

    # -- the view of the next forward ----------------------------------------------------------
    def uniform(self, n: int, span: int) -> "SlotCache":
        """The next forward writes rows ``0..n-1`` at its ``start_pos`` and attends to slots ``0..span-1``."""
        self._view = ("uniform", n, span)
        return self

    def ragged(self, slots: torch.Tensor, span: int) -> "SlotCache":
        """The next forward writes row ``j``'s token at ``slots[j]`` (``(n,)``), attending to ``0..span-1``.

        The writes go through one flat index into a layer's ``(rows·heads·slots, head_dim)`` view, made
        here once for every layer and for keys and values alike (``index_copy_``: cheaper per call than
        the advanced-index assignment it replaces, which rebuilt its broadcast indices each time)."""
        self._view = ("ragged", self._ragged_index(slots), span)
        return self

    def _ragged_index(self, slots: torch.Tensor) -> torch.Tensor:
        """``(n·heads,)``: where row ``j``'s head ``h`` writes its token, at ``slots[j]``, in a layer's flat view."""
        n, heads = slots.shape[0], self.cfg.n_kv_heads
        rows = torch.arange(n, device=slots.device)[:, None] * heads + torch.arange(heads, device=slots.device)
        return (rows * self.max_len + slots[:, None]).reshape(-1)  # (n·heads,): row j, head h at slots[j]

    def prefill(self, rows: list[int]) -> "SlotCache":
        """The next forward (a right-padded group of prompts) fills cache rows ``rows`` from slot 0."""
        first = rows[0]
        contiguous = rows == list(range(first, first + len(rows)))
        index = slice(first, first + len(rows)) if contiguous else torch.tensor(rows, device=self.device)
        self._view = ("prefill", index, 0)
        return self

    def packed(self, rows: list[int], places: list[tuple[int, int]], lengths: list[int], width: int) -> "SlotCache":
        """The next forward (prompts packed into ``(B, width)`` bins, ``stemlm.inference.core.pack_prompts``)
        stores prompt ``j``, at bin ``places[j] = (b, offset)`` with ``lengths[j]`` tokens, into cache row
        ``rows[j]`` from slot 0; the bins attend only to themselves, so their own keys are returned.

        One gather and one ``index_copy_`` per layer and per keys / values: ``src`` picks the real tokens
        out of the ``(B·width)`` bin positions, ``dst`` is where each lands in a layer's
        ``(rows·heads·slots, head_dim)`` view, for every head."""
        self._view = ("packed", self._packed_index(rows, places, lengths, width), 0)
        return self

    def _packed_index(self, rows: list[int], places: list[tuple[int, int]], lengths: list[int],
                      width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(src, dst)`` of ``packed``: the prompts' tokens among the bins' positions, and where each lands."""
        src, base = [], []
        for row, (b, off), n in zip(rows, places, lengths):
            src.extend(range(b * width + off, b * width + off + n))
            base.extend(range(row * self.cfg.n_kv_heads * self.max_len, row * self.cfg.n_kv_heads * self.max_len + n))
        heads = torch.arange(self.cfg.n_kv_heads, device=self.device) * self.max_len
        dst = (torch.tensor(base, device=self.device)[:, None] + heads).reshape(-1)  # (N·heads,): token-major
        return torch.tensor(src, device=self.device), dst

    def mixed(self, slots: torch.Tensor, span: int, step_mask: torch.Tensor, rows: list[int],
              places: list[tuple[int, int]], lengths: list[int], width: int, prefill_mask: torch.Tensor) -> "SlotCache":
        """The next forward is a decode step with a prefill merged into it (``DecodeCore.step(join=...)``): one
        sequence of ``n + B·width`` tokens, the ``n = len(slots)`` running rows' newest tokens (as ``ragged``:
        row ``j`` writes at ``slots[j]`` and sees slots ``0..span-1`` under the additive ``step_mask (n, 1, 1,
        span)``) and then ``B`` bins of ``width`` packed prompts (as ``packed``, each bin under ``prefill_mask
        (B, 1, width, width)``). Each part attends to its own keys, in its own ``attend`` call."""
        self._view = ("mixed", (self._ragged_index(slots), step_mask, self._packed_index(rows, places, lengths, width),
                                prefill_mask), span)
        return self

    @property
    def splits_attention(self) -> bool:
        """Whether the next forward's attention is ``attend`` (a ``mixed`` view)."""
        return self._view[0] == "mixed"

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """A ``mixed`` forward's attention in layer ``layer_idx``: ``q (1, nh, N, hd)``, ``k, v (1, nkv, N, hd)``
        (rotated) are stored as the view says and attended to per part; the output ``(1, nh, N, hd)``."""
        (flat, step_mask, (src, dst), prefill_mask), span = self._view[1], self._view[2]
        K, V = self.k[layer_idx], self.v[layer_idx]
        n, bins, width = step_mask.shape[0], prefill_mask.shape[0], prefill_mask.shape[-1]
        gqa = q.shape[1] != k.shape[1]
        step_q, step_k, step_v = (t[0, :, :n].transpose(0, 1)[:, :, None] for t in (q, k, v))  # (n, h, 1, hd)
        self._write_tokens(K, V, flat, step_k, step_v)
        step_y = F.scaled_dot_product_attention(step_q, K[:n, :, :span], V[:n, :, :span], attn_mask=step_mask,
                                                enable_gqa=gqa)  # (n, nh, 1, hd)
        pre_q, pre_k, pre_v = (t[0, :, n:].unflatten(1, (bins, width)).transpose(0, 1) for t in (q, k, v))  # (B, h, W, hd)
        self._write_packed(K, V, src, dst, pre_k, pre_v)
        pre_y = F.scaled_dot_product_attention(pre_q, pre_k, pre_v, attn_mask=prefill_mask, enable_gqa=gqa)
        return torch.cat((step_y[:, :, 0].transpose(0, 1), pre_y.transpose(0, 1).flatten(1, 2)), dim=1)[None]

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor, start_pos: int):
        """Store ``k, v (n, nkv, T, hd)`` as the current view says; the keys and values to attend to."""
        kind, where, span = self._view
        K, V = self.k[layer_idx], self.v[layer_idx]
        n, T = k.shape[0], k.shape[2]
        if kind == "uniform":
            K[:n, :, start_pos:start_pos + T] = k
            V[:n, :, start_pos:start_pos + T] = v
            return K[:n, :, :span], V[:n, :, :span]
        if kind == "ragged":
            self._write_tokens(K, V, where, k, v)
            return K[:n, :, :span], V[:n, :, :span]
        if kind == "packed":
            self._write_packed(K, V, *where, k, v)
            return k, v
        if kind == "mixed":
            raise RuntimeError("a mixed forward's attention is SlotCache.attend, not update")
        if isinstance(where, slice):
            K[where, :, :T] = k
            V[where, :, :T] = v
        else:
            K[:, :, :T].index_copy_(0, where, k)
            V[:, :, :T].index_copy_(0, where, v)
        return k, v

    @staticmethod
    def _write_tokens(K: torch.Tensor, V: torch.Tensor, flat: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Row ``j``'s one new token ``k, v (n, nkv, 1, hd)`` to its own slot (``flat``, ``_ragged_index``)."""
        hd = k.shape[-1]
        K.view(-1, hd).index_copy_(0, flat, k[:, :, 0].reshape(-1, hd))  # (n·nkv, hd) at each row's own slot
        V.view(-1, hd).index_copy_(0, flat, v[:, :, 0].reshape(-1, hd))

    @staticmethod
    def _write_packed(K: torch.Tensor, V: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, k: torch.Tensor,
                      v: torch.Tensor) -> None:
        """The real tokens of packed bins ``k, v (B, nkv, W, hd)`` to their rows' slots (``_packed_index``)."""
        hd = k.shape[-1]
        for buf, new in ((K, k), (V, v)):  # (B, nkv, W, hd) -> the real tokens (N, nkv, hd) -> (N·nkv, hd)
            tokens = new.transpose(1, 2).reshape(-1, new.shape[1], hd).index_select(0, src)
            buf.view(-1, hd).index_copy_(0, dst, tokens.reshape(-1, hd))

    def keep(self, rows: list[int], length: int) -> None:
        """Move rows ``rows`` (in that order) to ``0..len(rows)-1``, copying their first ``length`` slots."""
        if rows == list(range(len(rows))):
            return
        index = torch.tensor(rows, device=self.device)
        for buf in (*self.k, *self.v):
            buf[:len(rows), :, :length] = buf[:, :, :length].index_select(0, index)
