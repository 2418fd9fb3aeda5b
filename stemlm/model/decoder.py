"""The STEM decoder: a Llama (RMSNorm, RoPE, GQA attention, SwiGLU) whose chosen FFN layers take a
token-indexed table row instead of (or added to) the up-projection.

Differences from a plain Llama:
* ``cfg.layer_kinds[i]`` selects the FFN kind of layer ``i`` (``stemlm.ffn``, one class per kind);
* every table layer ``i`` has a table ``self.tables[str(i)]``; ``forward`` gets the rows of all
  of them in one call, ``self.tables.rows(ids)`` (the ids are made unique once), and passes each
  block its layer's rows, as nanochat passes value embeddings. A caller may pass the rows itself
  (``table_rows``). This file does not know where the rows are stored;
* input embedding and LM head are untied unless ``cfg.tie_embeddings``.

RoPE uses the rotate-half convention of Hugging Face Llama, so HF weights load unpermuted.
Attention goes through ``F.scaled_dot_product_attention``. Parallelism, offload and compile are
applied from outside.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..config import ModelConfig
from ..ffn import FFNKind, ffn_kind
from ..runtime.matmul import matmul_backend_of
from .loss import linear_cross_entropy
from ..ffn.ngram import NgramKeys, hash_plan
from ..ffn.rows import as_rows
from .tables import MergedRows, StemTable, Tables, check_ids, init_table_, summed_rows


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in fp32, as in HF Llama."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        if x.dtype == self.weight.dtype == torch.float32:  # one fused kernel each way, same values
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """cos/sin tables ``(T, head_dim)`` for the given positions (rotate-half layout)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    freqs = positions.float()[:, None] * inv_freq[None, :]  # (T, hd/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (T, hd)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` of shape ``(B, nh, T, hd)``."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Attention(nn.Module):
    """Grouped-query attention with an optional KV cache (``cache.update(layer, k, v, start)``, or the cache's own
    ``attend`` while its ``splits_attention``: ``stemlm.inference.kv_cache``)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.d_model, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.d_model, bias=False)

    def forward(self, x, cos, sin, start_pos: int, cache=None, mask=None):
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # (B, nh, T, hd)
        k = self.wk(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, nkv, T, hd)
        v = self.wv(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, nkv, T, hd)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None and cache.splits_attention:  # a decode step and a prefill in one forward
            y = cache.attend(self.layer_idx, q, k, v)  # (B, nh, T, hd)
        else:
            if cache is not None:
                k, v = cache.update(self.layer_idx, k, v, start_pos)  # (B, nkv, S, hd), S = start_pos + T
            gqa = self.n_heads != self.n_kv_heads
            if mask is None and start_pos == 0 and T > 1:
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
            else:  # decode (T == 1 sees everything cached) or an explicit mask
                y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        y = y.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim)  # (B, T, d)
        return self.wo(y)


class Block(nn.Module):
    """Pre-norm transformer block; ``rows`` are the layer's table rows (table layers only)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.kind = cfg.layer_kinds[layer_idx]
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg, layer_idx)
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.ffn = ffn_kind(self.kind)(cfg)

    def forward(self, x, cos, sin, start_pos, ids, rows=None, cache=None, mask=None):
        x = x + self.attn(self.attn_norm(x), cos, sin, start_pos, cache, mask)
        return x + self.ffn(self.ffn_norm(x), rows=rows, ids=ids)


def attention_mask(doc_ids: torch.Tensor | None, start_pos: int, q_len: int, device) -> torch.Tensor | None:
    """Boolean mask ``(B|1, 1, T, S)``, True = may attend; None when plain causal suffices.

    ``doc_ids (B, T)`` restricts attention to the same document (cross-document masking).
    """
    if doc_ids is None and (start_pos == 0 or q_len == 1):
        return None
    q_pos = torch.arange(start_pos, start_pos + q_len, device=device)
    k_pos = torch.arange(start_pos + q_len, device=device)
    mask = (k_pos[None, :] <= q_pos[:, None])[None, None]  # (1, 1, T, S)
    if doc_ids is not None:
        if start_pos != 0:
            raise ValueError("doc_ids masking is supported for full-sequence forward passes only")
        same_doc = doc_ids[:, :, None] == doc_ids[:, None, :]  # (B, T, T)
        mask = mask & same_doc[:, None]
    return mask


def padding_mask(real: torch.Tensor, start_pos: int, q_len: int) -> torch.Tensor:
    """Attention mask ``(B, 1, T, S)`` for queries at slots ``start_pos..start_pos+T-1`` over keys
    ``real (B, S)`` (False = padding): causal, padding hidden, a padding slot sees only itself (so
    no row is empty)."""
    keys = torch.arange(real.shape[1], device=real.device)
    queries = torch.arange(start_pos, start_pos + q_len, device=real.device)
    causal = keys[None, :] <= queries[:, None]  # (T, S)
    own = keys[None, :] == queries[:, None]  # (T, S)
    return (causal & (real[:, None, :] | own))[:, None]  # (B, 1, T, S)


class _TorchInit:
    """The plain-torch ``normal_``/``ones_``/``copy_`` used by ``init_module_``."""

    normal_, ones_ = staticmethod(nn.init.normal_), staticmethod(nn.init.ones_)

    @staticmethod
    def copy_(tensor: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        return tensor.copy_(other)


@torch.no_grad()
def init_module_(module: nn.Module, cfg: ModelConfig, init=_TorchInit) -> None:
    """Initialise one module's own weights: Normal(0, init_std) matrices, unit norms, tables per
    ``cfg.table_init``. ``init`` supplies ``normal_``/``ones_``/``copy_`` (transformers passes its
    guarded versions so ``from_pretrained`` only fills tensors a checkpoint did not provide)."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        init.normal_(module.weight, std=cfg.init_std)
    elif isinstance(module, RMSNorm):
        init.ones_(module.weight)
    elif isinstance(module, FFNKind):  # parameters of a kind's own (Hash-MoE's experts); its Linears come above
        module.init_weights_(cfg, init)
    elif isinstance(module, StemTable):
        init_table_(module.weight, cfg.table_init, cfg.d_model, cfg.init_std)
    elif isinstance(module, NgramKeys):  # the fixed hash plan (non-persistent buffers) and the identity canon
        for buf, value in zip((module.powers, module.mult), hash_plan(cfg.ngram_orders, cfg.ngram_heads, cfg.ngram_seed)):
            init.copy_(buf, value)
        if module.canon is not None:
            init.copy_(module.canon, torch.arange(cfg.vocab_size))


class StemLM(nn.Module):
    """A STEM language model; ``forward(ids) -> logits (B, T, V)``."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.tables = Tables({str(i): StemTable(cfg.table_rows(i), cfg.d_ff) for i in cfg.table_layers})
        self.ngram_keys = NgramKeys(cfg) if cfg.ngram_layers else None  # keys of n-gram layers (stemlm.ffn.ngram)
        self._ngram_layers = tuple(str(i) for i in cfg.ngram_layers)  # table keys of n-gram layers (fixed by cfg)
        self._token_layers = tuple(str(i) for i in cfg.table_layers if str(i) not in self._ngram_layers)
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_embeddings.weight
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Normal(0, init_std) weights, unit norms, tables per ``cfg.table_init``."""
        for module in self.modules():
            init_module_(module, self.cfg)

    def forward(self, ids: torch.Tensor, *, start_pos: int = 0, cache=None, doc_ids=None,
                return_hidden: bool = False, targets: torch.Tensor | None = None,
                positions: torch.Tensor | None = None, attn_mask: torch.Tensor | None = None,
                table_rows: Mapping[str, torch.Tensor] | None = None, context: torch.Tensor | None = None,
                check: bool = True) -> torch.Tensor:
        """Logits ``(B, T, V)`` for token ids ``(B, T)`` at positions ``start_pos ...``.

        ``cache`` (optional) keeps keys/values across calls: any object with ``update(layer, k, v, start)``
        and ``splits_attention`` (``stemlm.inference.kv_cache.SlotCache``, the HF wrapper's adapter);
        ``doc_ids (B, T)`` masks attention across documents; ``return_hidden`` returns the
        final normed hidden states ``(B, T, d)`` instead of logits; with ``targets (B, T)``
        (``-100`` = ignore) the mean cross-entropy is returned instead, computed by
        ``loss.linear_cross_entropy`` without materialising the logits.

        Packed or padded batches: ``positions (B, T)`` gives every token its own RoPE position
        (``start_pos`` then only names the cache slots written), and ``attn_mask (B|1, 1, T, S)``
        (True = may attend) replaces the causal mask.

        ``table_rows`` maps each table layer (``"1"``, ...) to its rows ``(B, T, d_ff)`` for ``ids``;
        by default ``self.table_rows(ids, context)`` gathers them. ``context (B, c)``: the tokens just
        before ``ids[:, 0]`` (``-1`` = none), which n-gram keys of the first positions hash (a cached
        decode step passes its sequences' last tokens); None: ``ids`` start their sequences.

        ``check=False`` skips the id and length checks, which read values back to the host: a
        captured decode step (``stemlm.inference.static``) may not synchronise.
        """
        cfg = self.cfg
        if ids.dim() != 2:
            raise ValueError(f"ids must have shape (batch, seq), got {tuple(ids.shape)}")
        B, T = ids.shape
        if check:
            check_ids(ids, cfg.vocab_size)
            last = start_pos + T if positions is None else int(positions.max()) + 1
            if last > cfg.max_seq_len:
                raise ValueError(f"sequence of {last} positions exceeds max_seq_len={cfg.max_seq_len}")
        x = self.tok_embeddings(ids)  # (B, T, d)
        if positions is None:
            cos, sin = rope_cos_sin(torch.arange(start_pos, start_pos + T, device=ids.device), cfg.head_dim,
                                    cfg.rope_theta, x.dtype)
        else:
            cos, sin = rope_cos_sin(positions.reshape(-1), cfg.head_dim, cfg.rope_theta, x.dtype)
            cos, sin = cos.view(B, 1, T, -1), sin.view(B, 1, T, -1)  # (B, 1, T, hd): broadcast over heads
        mask = attention_mask(doc_ids, start_pos, T, ids.device) if attn_mask is None else attn_mask
        if table_rows is None:
            table_rows = self.table_rows(ids, context)
        elif missing := [str(i) for i in cfg.table_layers if str(i) not in table_rows]:
            raise ValueError(f"table_rows has no rows for table layer(s) {', '.join(missing)}")
        for i, block in enumerate(self.layers):
            if not block.ffn.owns_table:
                rows = None
            elif block.ffn.keyed_by == "ngram":  # the memory Σ_k U[k] (B, T, d_ff), one gather-and-sum
                rows = summed_rows(table_rows, str(i))
            else:
                rows = table_rows[str(i)]  # (B, T, d_ff), or IndexedRows
            if not block.ffn.fuses_row_gather:
                rows = as_rows(rows)
            x = block(x, cos, sin, start_pos, ids, rows=rows, cache=cache, mask=mask)
        h = self.norm(x)
        if targets is not None:
            backend = matmul_backend_of(self.lm_head)  # the head's own kernels (stemlm.runtime.matmul)
            return linear_cross_entropy(h, self.lm_head.weight, targets, backend=backend)
        return h if return_hidden else self.lm_head(h)

    @property
    def mixed_keys(self) -> bool:
        """Some table layers are keyed by tokens and others by n-grams: one lookup per key kind."""
        return bool(self._ngram_layers and self._token_layers)

    def table_keys(self, ids: torch.Tensor, context: torch.Tensor | None = None,
                   real: torch.Tensor | None = None) -> torch.Tensor:
        """What the tables are indexed by for ``ids (B, T)``: the ids themselves, or for a model whose
        tables are n-gram keyed, keys ``(B, T, K)`` (``stemlm.ffn.ngram.ngram_keys``; ``context`` as in
        ``forward``, ``real (B, T)`` marks text among left padding). Prefetch, dedup and the step's row
        gathers take these."""
        if self.ngram_keys is None or self.mixed_keys:
            return ids
        return self.ngram_keys.forward(ids, context, real)  # a fixed function: no module hooks to run

    def table_rows(self, ids: torch.Tensor, context: torch.Tensor | None = None, tables=None,
                   real: torch.Tensor | None = None) -> Mapping[str, torch.Tensor]:
        """Every table layer's rows for ``ids (B, T)`` (``tables.rows`` of ``table_keys``; ``tables``
        defaults to ``self.tables``): the token rows ``(B, T, d_ff)`` of token-keyed layers and the
        ``(B, T, K, d_ff)`` rows of n-gram layers (``context``, ``real`` as in ``table_keys``)."""
        tables = self.tables if tables is None else tables
        if not self.mixed_keys:
            return tables.rows(self.table_keys(ids, context, real))
        return MergedRows(tables.rows(ids, layers=self._token_layers),
                          tables.rows(self.ngram_keys(ids, context, real), layers=self._ngram_layers))

    def prefetch_rows(self, ids: torch.Tensor, context: torch.Tensor | None = None, tables=None):
        """Start gathering the rows of ``ids`` on ``tables`` (default ``self.tables``; host and disk tiers
        gather in the background): the ticket to pass to the forward of ``ids`` as ``table_rows``, or None
        (nothing to prefetch, or a model keyed two ways, whose forward gathers each key kind itself)."""
        tables = self.tables if tables is None else tables
        return None if self.mixed_keys else tables.prefetch(self.table_keys(ids, context))

    def layer_keys(self, ids: torch.Tensor, context: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """Each table layer's keys, not made unique: ``ids`` for token layers, ``(B, T, K)`` for n-gram
        layers (what a step that gathers without ``torch.unique`` indexes, ``inference.static``)."""
        keys = None if self.ngram_keys is None else self.ngram_keys(ids, context)
        return {k: keys if k in self._ngram_layers else ids for k in self.tables.keys()}

    def table_parameters(self) -> list[nn.Parameter]:
        """Parameters of the in-memory tables (empty when tables live elsewhere)."""
        return [p for t in self.tables.values() for p in t.parameters()]

    def num_parameters(self) -> int:
        """Distinct parameters held by this module (tied weights counted once)."""
        return sum(p.numel() for p in {id(p): p for p in self.parameters()}.values())
