"""n-gram rows (Engram-style keys): rows keyed by the current token plus hashed bigrams and trigrams.

STEM keys a layer's row by the current token ``t_i`` alone. An n-gram layer reads ``K = 1 + |orders| · heads``
rows of its table ``U_l`` (``ngram_slots`` rows, ``d_ff`` wide) at every position ``i``:

* ``k_0 = t_i``, the current token (rows ``0 .. V-1`` are the token rows, so ``ngram_slots >= V``);
* for each order ``n`` in ``ngram_orders`` (default 2 and 3) and each hash head ``h < ngram_heads``:
  ``k_{n,h} = hash_{n,h}(t_{i-n+1}, ..., t_i) mod ngram_slots``.

The layer's memory is the sum of its K rows, ``m_i = Σ_k U_l[k]`` (K hash heads per order cut the
damage of any one collision: two n-grams share all their rows only if every head collides). Three ways
into the layer, one kind each:

| kind | layer output |
|---|---|
| ``ngram`` (STEM-style, eq. 4) | ``W_d (SiLU(W_g x) ⊙ m)`` |
| ``ngram_dagger`` (STEM†-style, eq. 5) | ``W_d (SiLU(W_g x) ⊙ (W_u x + m))`` |
| ``engram`` (Engram-style) | ``W_d (SiLU(W_g x) ⊙ W_u x) + α ⊙ W_v m``, ``α = σ(⟨ρ(x), ρ(W_k m)⟩ / √d)`` |

``ρ`` is an RMS norm without weights and ``x`` the layer's normed hidden state: the gate ``α`` (one
scalar per position) lets the context switch off a retrieved memory that does not fit it.

Hashing is deterministic and documented: tokens are first mapped through ``canon`` when the model has
one (``ngram_normalize``: case and leading space folded, ``stemlm.data.codec.canonical_ids``), a
position before the start of the sequence is the pad value ``V`` (so the first ``n-1`` positions of a
document hash their own short n-grams: ``(pad, t_0)`` is a bigram of its own), and

    h = 0;  for each token u of the n-gram, oldest first:  h = (h · a_{n,h} + u + 1) mod P
    k_{n,h} = ((h · b_{n,h}) mod P) mod ngram_slots,       P = 2^31 - 1

with ``a, b`` drawn once from ``torch.Generator().manual_seed(ngram_seed)`` (every product stays below
2^62: exact in int64 on every device). Keys are a pure function of the ids, so everything that knows
the ids before the forward knows the keys: prefetch, dedup and the row-sparse optimizers run on keys.
"""

from __future__ import annotations

import array
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..fields import ConfigError
from .base import FFNKind, linear

HASH_PRIME = 2**31 - 1
MAX_ORDER = 8
MAX_HEADS = 16


def check_ngram_fields(cfg) -> None:
    """One-line ``ConfigError`` for bad ``ngram_orders``/``ngram_heads``/``ngram_slots``/``ngram_seed``."""
    orders = cfg.ngram_orders
    if not orders:
        raise ConfigError("ngram_orders: empty; give orders such as [2, 3] (the current token is always a key)")
    if any(n < 2 or n > MAX_ORDER for n in orders):
        raise ConfigError(f"ngram_orders: {list(orders)} must each be in 2..{MAX_ORDER}")
    if len(set(orders)) != len(orders):
        raise ConfigError(f"ngram_orders: duplicate order in {list(orders)}")
    if not 1 <= cfg.ngram_heads <= MAX_HEADS:
        raise ConfigError(f"ngram_heads must be in 1..{MAX_HEADS}, got {cfg.ngram_heads}")
    if cfg.ngram_slots is not None and cfg.ngram_slots < cfg.vocab_size:
        raise ConfigError(f"ngram_slots={cfg.ngram_slots} must be >= vocab_size={cfg.vocab_size} "
                          "(rows 0..V-1 are the current token's)")
    if cfg.ngram_slots is not None and cfg.ngram_slots >= HASH_PRIME:
        raise ConfigError(f"ngram_slots={cfg.ngram_slots} must be < 2^31 - 1")
    if cfg.ngram_seed < 0:
        raise ConfigError(f"ngram_seed must be >= 0, got {cfg.ngram_seed}")


def keys_per_position(cfg) -> int:
    """``K = 1 + |orders| · heads``: the rows an n-gram layer reads at every position."""
    return 1 + len(cfg.ngram_orders) * cfg.ngram_heads


def context_reach(cfg) -> int:
    """The tokens before a position that its n-gram keys hash, ``max(ngram_orders) - 1`` (what a decode step
    keeps per sequence as its ``context``)."""
    return max(cfg.ngram_orders) - 1


def hash_factors(orders: tuple[int, ...], heads: int, seed: int) -> torch.Tensor:
    """``(|orders|, heads, 2)`` int64 multipliers ``a, b`` in ``[1, P)`` of every order's hash heads."""
    gen = torch.Generator().manual_seed(seed)  # on the CPU, also under a meta-device context (a model skeleton)
    return torch.randint(1, HASH_PRIME, (len(orders), heads, 2), generator=gen, dtype=torch.int64, device="cpu")


SMALL = 16  # positions up to which ngram_keys hashes in Python integers (the same keys, fewer dispatches)


def hash_plan(orders: tuple[int, ...], heads: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(powers (N, H), b (H,))``: the hash of every (order, head) column ``c`` as one weighted sum.

    Horner's ``h = (h·a + u + 1) mod P`` over an n-gram equals ``Σ_j (u_j + 1)·a^(n-1-j) mod P``; with the
    window of the last ``N = max(orders)`` tokens, ``powers[j, c] = a_c^(N-1-j) mod P`` for the ``n_c``
    newest tokens and 0 for older ones, so all heads of all orders come from one product (``ngram_keys``).
    Columns are ordered by order, then head."""
    factors = hash_factors(orders, heads, seed)
    N = max(orders)
    powers = torch.zeros(N, len(orders) * heads, dtype=torch.int64, device="cpu")
    for o, n in enumerate(orders):
        for h in range(heads):
            a, c = int(factors[o, h, 0]), o * heads + h
            for j in range(N - n, N):
                powers[j, c] = pow(a, N - 1 - j, HASH_PRIME)
    return powers, factors[..., 1].reshape(-1)


def ngram_keys(ids: torch.Tensor, context: torch.Tensor | None, cfg, plan: tuple[torch.Tensor, torch.Tensor],
               canon: torch.Tensor | None = None, real: torch.Tensor | None = None,
               columns: tuple[int, list] | None = None) -> torch.Tensor:
    """Keys ``(B, T, K)`` of ``ids (B, T)``: the token, then every order's hash heads (module docstring).

    ``context (B, c)`` holds the tokens just before ``ids[:, 0]`` (newest last; ``-1`` = before the
    sequence start); None means ``ids`` start the sequence. ``plan`` is ``hash_plan(...)`` (on ``ids``'
    device), ``canon (V,)`` an optional token -> canonical token map applied before hashing. ``real (B, T)``
    (optional, bool) marks the positions of ``ids`` that hold text: the others (left padding of a
    batch) hash as before the sequence start, so a padded prompt's keys are those it has alone (the
    token key of a padding position is still its id). ``columns``: ``hash_columns(plan)`` when the caller
    keeps it (few CPU positions are hashed in Python integers from it: the same keys, fewer dispatches).
    """
    B, T = ids.shape
    powers, mult = plan
    N = powers.shape[0]  # the longest order: the window of tokens each position hashes
    if ids.device.type == "cpu" and B * T <= SMALL and canon is None and real is None:
        return _small_keys(ids, context, cfg, columns or hash_columns(plan))  # a decode step
    if context is None or context.shape[1] == 0:
        before = ids.new_full((B, N - 1), -1)
    else:
        before = context[:, -(N - 1):].to(ids.device, ids.dtype)
        if before.shape[1] < N - 1:
            before = torch.cat([before.new_full((B, N - 1 - before.shape[1]), -1), before], 1)
    seq = torch.cat([before, ids], 1)  # (B, N - 1 + T)
    text = seq >= 0
    if real is not None:
        text[:, N - 1:] &= real.to(text.device, torch.bool)
    real = text
    if canon is not None:
        seq = torch.where(real, canon[seq.clamp(min=0)], seq)
    seq = torch.where(real, seq, cfg.vocab_size) + 1  # before the start -> V + 1, token u -> u + 1
    window = seq.unfold(1, N, 1)  # (B, T, N): the N tokens ending at each position, oldest first
    terms = window[..., None] * powers  # (B, T, N, H): each < (V + 2) · 2^31
    if cfg.vocab_size >= 1 << 28:  # the sum of N <= 8 terms could pass 2^63: reduce each term first
        terms = terms % HASH_PRIME
    h = terms.sum(-2) % HASH_PRIME  # (B, T, H)
    keys = (h * mult) % HASH_PRIME % (cfg.ngram_slots or cfg.vocab_size)
    return torch.cat([ids[..., None], keys], -1)  # (B, T, K)


def hash_columns(plan: tuple[torch.Tensor, torch.Tensor]) -> tuple[int, list]:
    """``(N, [(b_c, [(j, a_c^(N-1-j)) ...]) per column])``: ``hash_plan`` as Python integers, its zero terms dropped."""
    powers, mult = (t.tolist() for t in plan)
    return len(powers), [(m, [(j, powers[j][c]) for j in range(len(powers)) if powers[j][c]]) for c, m in enumerate(mult)]


def _window_keys(out: array.array, token: int, seq: list[int], start: int, columns: list, slots: int) -> None:
    """Append the keys of one position to ``out``: its ``token``, then every (order, head) column hashed from the
    window ``seq[start:start + N]`` (tokens + 1, the pad value before the start; ``columns``: ``hash_columns``'s list)."""
    out.append(token)
    for m, terms in columns:
        h = 0
        for j, p in terms:
            h += seq[start + j] * p
        out.append(h % HASH_PRIME * m % HASH_PRIME % slots)


def _keys_tensor(out: array.array, B: int, T: int, K: int) -> torch.Tensor:
    """The flat keys ``out`` as a ``(B, T, K)`` tensor (sharing the buffer)."""
    return torch.frombuffer(out, dtype=torch.long).view(B, T, K) if out else torch.empty(B, T, K, dtype=torch.long)


def _small_keys(ids: torch.Tensor, context: torch.Tensor | None, cfg, columns: tuple[int, list]) -> torch.Tensor:
    """``ngram_keys`` of a few positions on the CPU, in Python integers: the same weighted sum mod ``P``
    (``columns``: ``hash_columns`` of the plan)."""
    N, columns = columns
    slots, pad = cfg.ngram_slots or cfg.vocab_size, cfg.vocab_size + 1
    B, T = ids.shape
    before = [[] for _ in range(B)] if context is None else context.tolist()
    out = array.array("q")  # (B, T, K) flat: one buffer for the tensor, no nested lists to convert
    for row, ctx in zip(ids.tolist(), before):
        ctx = ctx[len(ctx) - (N - 1):] if len(ctx) > N - 1 else ctx
        seq = [pad] * (N - 1 - len(ctx)) + [u + 1 if u >= 0 else pad for u in ctx] + [u + 1 for u in row]
        for i, t in enumerate(row):  # the window of position i is seq[i:i + N], oldest first
            _window_keys(out, t, seq, i, columns, slots)
    return _keys_tensor(out, B, T, 1 + len(columns))


def newest_keys(windows: list[list[int]], cfg, columns: tuple[int, list]) -> torch.Tensor:
    """Keys ``(n, 1, K)`` of the newest token of ``n`` sequences, from ``windows[j]``: the last ``<= N`` tokens of
    sequence ``j`` (``N = max(orders)``, oldest first, the newest last; fewer than ``N`` only at a sequence's start).
    What a decode step feeds, hashed from the decode core's own token lists in Python integers (no tensors in
    between): the keys ``ngram_keys`` gives the same position (tested). ``columns``: ``hash_columns`` of the plan."""
    N, columns = columns
    slots, pad = cfg.ngram_slots or cfg.vocab_size, cfg.vocab_size + 1
    out = array.array("q")
    for window in windows:
        _window_keys(out, window[-1], [pad] * (N - len(window)) + [u + 1 for u in window], 0, columns, slots)
    return _keys_tensor(out, len(windows), 1, 1 + len(columns))


class NgramKeyed(FFNKind):
    """What the n-gram kinds share: a table of ``ngram_slots`` rows read at K keys per position, whose rows
    reach ``forward`` summed to the memory ``m (B, T, d_ff)``; not converted from a dense Llama (insertion
    calibrates token rows; n-gram slots have no dense counterpart to fit)."""

    owns_table = True
    from_dense = False
    keyed_by = "ngram"

    @classmethod
    def table_rows(cls, cfg) -> int:
        return cfg.ngram_slots or cfg.vocab_size

    @classmethod
    def rows_per_token(cls, cfg) -> int:
        return keys_per_position(cfg)


class NgramFFN(NgramKeyed):
    """STEM with n-gram keys: ``W_d (SiLU(W_g x) ⊙ m)``, ``m`` the sum of the position's K rows."""

    name = "ngram"
    holds = ("w_gate", "w_down")
    table_from = "w_up"

    def forward(self, x, rows=None, ids=None):  # rows: the memory m (B, T, d_ff), the K rows summed
        return self.w_down(F.silu(self.w_gate(x)) * rows)


class NgramDaggerFFN(NgramKeyed):
    """STEM† with n-gram keys: ``W_d (SiLU(W_g x) ⊙ (W_u x + m))``."""

    name = "ngram_dagger"
    table_from = "w_up"
    zero_rows_are_dense = True

    def forward(self, x, rows=None, ids=None):
        return self.w_down(F.silu(self.w_gate(x)) * (self.w_up(x) + rows))


class EngramFFN(NgramKeyed):
    """A dense SwiGLU plus an Engram-style memory: ``+ α ⊙ W_v m``, ``α = σ(⟨ρ(x), ρ(W_k m)⟩ / √d)``."""

    name = "engram"
    holds = ("w_gate", "w_up", "w_down")

    def __init__(self, cfg):
        super().__init__(cfg)
        self.w_mem_key = linear(cfg.d_ff, cfg.d_model)  # (d_ff -> d)
        self.w_mem_value = linear(cfg.d_ff, cfg.d_model)

    def forward(self, x, rows=None, ids=None):
        dense = self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))
        m = rows  # the memory (B, T, d_ff): the position's K rows summed by the model
        key = self.w_mem_key(m)
        d = x.shape[-1]
        alpha = torch.sigmoid((F.rms_norm(x, (d,)) * F.rms_norm(key, (d,))).sum(-1, keepdim=True) / math.sqrt(d))
        return dense + alpha * self.w_mem_value(m)

    @classmethod
    def weights(cls, cfg) -> int:
        return (len(cls.holds) + 2) * cfg.d_model * cfg.d_ff  # the SwiGLU plus W_k, W_v


NGRAM_KINDS = (NgramFFN, NgramDaggerFFN, EngramFFN)


class NgramKeys(nn.Module):
    """The model's n-gram key function (``ngram_keys``) with its fixed hash plan and, with
    ``ngram_normalize``, its ``canon`` map (a buffer saved with the model: the keys of a checkpoint
    do not depend on a tokenizer found at load time)."""

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        powers, mult = hash_plan(cfg.ngram_orders, cfg.ngram_heads, cfg.ngram_seed)
        self.register_buffer("powers", powers, persistent=False)  # fixed by the config: rebuilt, never saved
        self.register_buffer("mult", mult, persistent=False)
        self._columns = hash_columns((powers, mult))  # the same plan for the small path (fixed by the config)
        canon = torch.arange(cfg.vocab_size, device="cpu") if cfg.ngram_normalize else None
        self.register_buffer("canon", canon, persistent=cfg.ngram_normalize)

    def newest(self, windows: list[list[int]]) -> torch.Tensor | None:
        """``newest_keys`` of ``windows`` (the last tokens of each sequence, newest last) on the CPU; None when the
        model normalises tokens before hashing (``ngram_normalize``: the tensor path applies ``canon``)."""
        return None if self.canon is not None else newest_keys(windows, self.cfg, self._columns)

    def forward(self, ids: torch.Tensor, context: torch.Tensor | None = None,
                real: torch.Tensor | None = None) -> torch.Tensor:
        """Keys ``(B, T, K)`` of ``ids (B, T)`` after ``context (B, c)``, ``real`` marking text (see ``ngram_keys``)."""
        return ngram_keys(ids, context, self.cfg, (self.powers, self.mult), self.canon, real, self._columns)
