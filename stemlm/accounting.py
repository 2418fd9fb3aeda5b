"""Exact parameter, FLOP and byte accounting of a ``ModelConfig``: the one place that counts.

Nothing here builds a model; the tests check every count against a real ``StemLM``.

Conventions (see docs/accounting.md for the derivations and the paper's numbers):

* **Parameters.** Every table is counted in ``total_params`` (``table_rows × d_ff`` each: ``V`` rows
  for token keys, ``ngram_slots`` for n-gram keys, ``cfg.table_rows(layer)``); tied embeddings are
  counted once; RMSNorm weights are counted; an ``engram`` layer counts its SwiGLU and its two
  memory projections ``W_k, W_v`` (``2·d·d_ff`` more). This equals ``StemLM(cfg).num_parameters()``.
* **Active parameters per token.** A STEM-family layer uses one table row (``d_ff``), an n-gram
  layer (``ngram``, ``ngram_dagger``, ``engram``) the ``K = 1 + |orders|·heads`` rows of its keys
  (``K·d_ff``), a Hash-MoE layer one expert (``3·d·d_ff``). The input embedding is counted as the *whole*
  ``V × d`` matrix by default (``embedding="table"``), the convention under which the paper's
  Table 3 gives 1.41B active parameters for STEM-1/3 Llama-3.2-1B; ``embedding="row"`` counts
  only the ``d`` values a token reads (what a decode step actually loads).
* **FLOPs.** Matrix multiplications only, ``FLOPs = 2 · MACs``; norms, RoPE, SiLU, softmax, the
  gating product and STEM†'s row addition (``d_ff`` adds per layer) are not counted; a table
  lookup is 0 FLOPs. The sum of an n-gram layer's K rows (``(K - 1)·d_ff`` adds per token) is not
  counted either (``table_sum_adds_per_token`` reports it beside the FLOPs); an ``engram`` layer's
  ``W_k m`` and ``W_v m`` are matmuls (``2·d·d_ff`` MACs, counted), its gate ``σ(⟨ρ(x), ρ(W_k m)⟩/√d)``
  (two norms and ``d`` products) is not. Projections are exact under GQA (``K``/``V`` have ``n_kv_heads`` heads).
  Attention scores ``QK^T`` and ``AV`` cost ``n_heads · head_dim · L`` MACs each per token with
  the **full-L** convention (what the paper's saving fraction uses, and exactly the cost of
  decoding the token at position ``L``); ``causal=True`` averages over a causal sequence
  instead (``(L + 1) / 2`` keys per query).
* **Training FLOPs** = 3 × forward: every matmul's backward is two matmuls of the same size
  (gradient of the input and of the weight; for attention, ``dQ, dK`` and ``dV, dP``).
* **Decode bytes** = active parameters with ``embedding="row"`` × bytes per value, for a
  batch of one: dense weights, LM head, one embedding row, one row per token-keyed table and K rows
  per n-gram table (``table_bytes_per_token``), one expert.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path

import numpy as np

from .config import ModelConfig
from .ffn import DenseFFN, EngramFFN, HashMoEFFN, StemFFN, ffn_kind

FLOPS_PER_MAC = 2
TRAIN_FLOPS_MULTIPLIER = 3  # forward + backward (2 × forward) for matmuls
EMBEDDING_CONVENTIONS = ("table", "row")


# -- parameters ------------------------------------------------------------------------------
def attention_params(cfg: ModelConfig) -> int:
    """Weights of one attention block: ``W_q, W_o`` (d × nh·hd) and ``W_k, W_v`` (d × nkv·hd)."""
    return 2 * cfg.d_model * cfg.n_heads * cfg.head_dim + 2 * cfg.d_model * cfg.n_kv_heads * cfg.head_dim


def ffn_params(cfg: ModelConfig, kind: str) -> dict[str, int]:
    """Parameters of one FFN layer of ``kind``: ``weights`` (projections/experts) and ``table``
    (each kind declares its own: ``stemlm.ffn``)."""
    k = ffn_kind(kind)
    return {"weights": k.weights(cfg), "table": k.table_params(cfg)}


def param_breakdown(cfg: ModelConfig) -> dict[str, int]:
    """Parameter counts by component; the values sum to ``total_params(cfg)``."""
    ffn = [ffn_params(cfg, kind) for kind in cfg.layer_kinds]
    emb = cfg.vocab_size * cfg.d_model
    return {
        "embedding": emb,
        "lm_head": 0 if cfg.tie_embeddings else emb,  # a tied head is the embedding, counted once
        "attention": cfg.n_layers * attention_params(cfg),
        "norms": (2 * cfg.n_layers + 1) * cfg.d_model,
        "ffn_weights": sum(p["weights"] for p in ffn),
        "tables": sum(p["table"] for p in ffn),
    }


def total_params(cfg: ModelConfig) -> int:
    """All parameters, tables included, tied embeddings once (== ``StemLM(cfg).num_parameters()``)."""
    return sum(param_breakdown(cfg).values())


def active_params(cfg: ModelConfig, embedding: str = "table") -> int:
    """Parameters one token uses: one row per table, one expert per Hash-MoE layer.

    ``embedding="table"`` counts the whole input embedding (the paper's Table 3 convention);
    ``"row"`` counts only the row the token reads (a tied embedding is the LM head, used whole).
    """
    if embedding not in EMBEDDING_CONVENTIONS:
        raise ValueError(f"embedding must be one of {EMBEDDING_CONVENTIONS}, got {embedding!r}")
    parts = param_breakdown(cfg)
    parts["tables"] = table_rows_per_token(cfg) * cfg.d_ff
    parts["ffn_weights"] = sum(ffn_kind(k).active_weights(cfg) for k in cfg.layer_kinds)
    if embedding == "row" and not cfg.tie_embeddings:
        parts["embedding"] = cfg.d_model
    return sum(parts.values())


def table_rows_per_layer(cfg: ModelConfig) -> dict[int, int]:
    """Rows of every table layer's table: ``V`` (token keys) or ``ngram_slots`` (n-gram keys)."""
    return {i: cfg.table_rows(i) for i in cfg.table_layers}


def rows_per_token_of_layer(cfg: ModelConfig) -> dict[int, int]:
    """Rows every table layer reads per token: 1 (token keys) or ``K = 1 + |orders|·heads`` (n-gram keys)."""
    return {i: ffn_kind(cfg.layer_kinds[i]).rows_per_token(cfg) for i in cfg.table_layers}


def table_rows_per_token(cfg: ModelConfig) -> int:
    """Table rows one token reads over all layers: 1 per token-keyed layer plus K per n-gram layer."""
    return sum(rows_per_token_of_layer(cfg).values())


def table_bytes_per_token(cfg: ModelConfig, dtype_bytes: int = 2) -> int:
    """Bytes of table rows one token reads: ``table_rows_per_token · d_ff · dtype_bytes`` (rows of
    ``d_ff`` values; a quantized row is ``RowCodec.row_bytes`` instead)."""
    return table_rows_per_token(cfg) * cfg.d_ff * dtype_bytes


def table_sum_adds_per_token(cfg: ModelConfig) -> int:
    """Additions per token that sum each n-gram layer's K rows, ``Σ (K - 1)·d_ff`` (not in the FLOP counts:
    they count matmuls only)."""
    return sum(ffn_kind(k).row_sum_adds_per_token(cfg) for k in cfg.layer_kinds)


# -- FLOPs -----------------------------------------------------------------------------------
def ffn_macs_per_token(cfg: ModelConfig, kind: str) -> int:
    """Multiply-accumulates of one FFN layer per token (a Hash-MoE token runs one expert)."""
    return ffn_kind(kind).macs_per_token(cfg)


def attention_score_macs_per_token(cfg: ModelConfig, seq_len: int, causal: bool = False) -> float:
    """MACs of ``QK^T`` plus ``AV`` for one token: ``2 · nh · hd · L`` (full-L convention).

    ``causal=True`` averages over the ``L`` queries of a causal sequence (query ``t`` sees
    ``t`` keys): ``2 · nh · hd · (L + 1) / 2``.
    """
    if seq_len <= 0:
        raise ValueError(f"seq_len must be positive, got {seq_len}")
    keys = (seq_len + 1) / 2 if causal else seq_len
    return 2 * cfg.n_heads * cfg.head_dim * keys


def layer_flops_per_token(cfg: ModelConfig, layer: int, seq_len: int, causal: bool = False) -> dict[str, float]:
    """Forward FLOPs of layer ``layer`` for one token: projections, attention scores, FFN, total."""
    kind = cfg.layer_kinds[layer]
    out = {
        "attn_proj": FLOPS_PER_MAC * attention_params(cfg),
        "attn_scores": FLOPS_PER_MAC * attention_score_macs_per_token(cfg, seq_len, causal),
        "ffn": FLOPS_PER_MAC * ffn_macs_per_token(cfg, kind),
    }
    out["total"] = sum(out.values())
    return {"layer": layer, "kind": kind, **out}


def forward_flops_per_layer(cfg: ModelConfig, seq_len: int, causal: bool = False) -> list[dict]:
    """``layer_flops_per_token`` for every layer."""
    return [layer_flops_per_token(cfg, i, seq_len, causal) for i in range(cfg.n_layers)]


def lm_head_flops_per_token(cfg: ModelConfig) -> int:
    """``2 · d · V``: the output projection (the input embedding lookup is free)."""
    return FLOPS_PER_MAC * cfg.d_model * cfg.vocab_size


def forward_flops_per_token(cfg: ModelConfig, seq_len: int, causal: bool = False) -> float:
    """Forward matmul FLOPs per token at sequence length ``seq_len`` (all layers + LM head)."""
    return sum(r["total"] for r in forward_flops_per_layer(cfg, seq_len, causal)) + lm_head_flops_per_token(cfg)


def train_flops_per_token(cfg: ModelConfig, seq_len: int, causal: bool = False) -> float:
    """Forward + backward matmul FLOPs per token: ``3 ×`` forward."""
    return TRAIN_FLOPS_MULTIPLIER * forward_flops_per_token(cfg, seq_len, causal)


BACKBONE_ADAMW_BYTES = 28  # fp32 AdamW per parameter: reads weight, grad, two moments; writes weight, two moments
TABLE_STEP_BYTES = 11 * 4  # per fp32 row element of a step's slot: gather (2), gradient buffer (2), row AdamW (7)


def train_step_bytes(cfg: ModelConfig, n_tokens: int, slots: int | None = None) -> dict[str, float]:
    """Memory traffic of a training step outside its GEMMs, bytes: the backbone's AdamW
    (``BACKBONE_ADAMW_BYTES`` per parameter) and the fused table path (``TABLE_STEP_BYTES`` per element
    of every table's ``slots`` rows). By default a table's slots are the static-shape slots of its keys,
    ``min(n_tokens · K, table_rows)`` (``stemlm.train.fused.dedup``: K = 1 for token keys, the n-gram keys
    of every position otherwise); ``slots`` gives every table that many instead.

    With ``train_flops_per_token`` this gives the roofline of a step: FLOPs at the GEMM rate plus these
    bytes at the memory bandwidth (``benchmarks/gpu_suite.py`` measures both)."""
    parts = param_breakdown(cfg)
    rows, keys = table_rows_per_layer(cfg), rows_per_token_of_layer(cfg)
    total = sum(min(n_tokens * keys[i], rows[i]) if slots is None else slots for i in cfg.table_layers)
    return {"backbone_optimizer": float((sum(parts.values()) - parts["tables"]) * BACKBONE_ADAMW_BYTES),
            "tables": float(total * cfg.d_ff * TABLE_STEP_BYTES)}


def roofline_step_s(cfg: ModelConfig, seq_len: int, n_tokens: int, flops_per_s: float, bytes_per_s: float,
                    slots: int | None = None) -> float:
    """The fastest a training step of ``n_tokens`` can be: its training FLOPs at ``flops_per_s``
    plus ``train_step_bytes`` at ``bytes_per_s``, seconds."""
    flops = train_flops_per_token(cfg, seq_len) * n_tokens
    return flops / flops_per_s + sum(train_step_bytes(cfg, n_tokens, slots).values()) / bytes_per_s


def saving_fraction(d_model: int, d_ff: int, seq_len: int) -> float:
    """The paper's per-layer FLOP saving of STEM: ``d·d_ff / (4d² + 2Ld + 3d·d_ff)``.

    Full-L MAC convention with multi-head attention projections (``4d²``); equals
    ``d_ff / (4d + 2L + 3d_ff)``.
    """
    return d_ff / (4 * d_model + 2 * seq_len + 3 * d_ff)


def layer_saving_fraction(cfg: ModelConfig, seq_len: int, kind: str | None = None) -> float:
    """Exact per-layer saving of ``kind`` (default ``cfg.ffn``) against a dense layer, GQA included."""
    kind = kind or cfg.ffn
    attn = attention_params(cfg) + attention_score_macs_per_token(cfg, seq_len)
    dense = attn + ffn_macs_per_token(cfg, DenseFFN.name)
    return (dense - attn - ffn_macs_per_token(cfg, kind)) / dense


def roi(accuracy: float, flops: float, base_accuracy: float, base_flops: float) -> float:
    """Accuracy per FLOP normalised to a baseline: ``(acc / flops) / (base_acc / base_flops)``."""
    if min(flops, base_flops, base_accuracy) <= 0:
        raise ValueError("flops, base_flops and base_accuracy must be positive")
    return (accuracy / flops) / (base_accuracy / base_flops)


# -- bytes -----------------------------------------------------------------------------------
def decode_param_bytes(cfg: ModelConfig, dtype_bytes: int = 2) -> int:
    """Parameter bytes read by one decode step of a batch of one (see module docstring)."""
    return active_params(cfg, embedding="row") * dtype_bytes


def kv_cache_bytes(cfg: ModelConfig, batch: int, seq_len: int, dtype_bytes: int = 2) -> int:
    """Keys and values of every layer for ``batch`` sequences of ``seq_len`` positions."""
    return 2 * cfg.n_layers * batch * seq_len * cfg.n_kv_heads * cfg.head_dim * dtype_bytes


# -- token statistics (for the offload planner) ----------------------------------------------
def zipf_probabilities(vocab: int, zipf_s: float = 1.0) -> np.ndarray:
    """``p_i ∝ i^{-s}`` over ranks ``i = 1..vocab`` (most frequent first)."""
    if vocab <= 0 or zipf_s < 0:
        raise ValueError(f"need vocab > 0 and zipf_s >= 0, got vocab={vocab}, zipf_s={zipf_s}")
    weights = np.arange(1, vocab + 1, dtype=np.float64) ** -zipf_s
    return weights / weights.sum()


def unique_rows_estimate(n_tokens: float, vocab: int, zipf_s: float = 1.0, skip_top: int = 0) -> float:
    """Expected number of distinct tokens among ``n_tokens`` i.i.d. Zipf draws over ``vocab`` ranks.

    Exact expectation ``Σ_i 1 - (1 - p_i)^n``. ``skip_top`` leaves out the ``skip_top`` most
    frequent ranks: the expected misses of a cache holding exactly those rows.
    """
    if n_tokens < 0 or not 0 <= skip_top <= vocab:
        raise ValueError(f"need n_tokens >= 0 and 0 <= skip_top <= vocab, got {n_tokens}, {skip_top}")
    p = zipf_probabilities(vocab, zipf_s)[skip_top:]
    # 1 - (1 - p)^n computed as -expm1(n·log1p(-p)) to stay exact for tiny p and large n
    return float(-np.expm1(n_tokens * np.log1p(-p)).sum())


def _binned(logp: np.ndarray, weight: np.ndarray, bins: int) -> tuple[np.ndarray, np.ndarray]:
    """``(p, count)``: outcomes of log-probabilities ``logp`` (``weight`` of each) pooled into ``bins``
    equal-width bins of ``log p``; a bin's ``p`` is its outcomes' mean probability (total mass kept)."""
    lo, hi = float(logp.min()), float(logp.max())
    idx = np.zeros(logp.shape, dtype=np.int64) if hi - lo < 1e-12 else \
        np.minimum(((logp - lo) / (hi - lo) * bins).astype(np.int64), bins - 1)
    count = np.bincount(idx, weight, bins)
    mass = np.bincount(idx, weight * np.exp(logp), bins)
    keep = count > 0
    return mass[keep] / count[keep], count[keep]


@functools.lru_cache(maxsize=256)  # a plan asks the same question for every table layer
def distinct_ngrams_estimate(n_tokens: float, vocab: int, order: int, zipf_s: float = 1.0, bins: int = 1024) -> float:
    """Expected distinct n-grams of order ``order`` among the ``n_tokens`` n-grams of ``n_tokens`` tokens,
    the tokens i.i.d. Zipf(``zipf_s``) over ``vocab`` ranks (``unique_rows_estimate``'s law).

    Under independence an n-gram is ``order`` independent draws, ``p(u_1..u_n) = Π p(u_j)``; its
    ``vocab^order`` outcomes are pooled by ``log p`` into ``bins`` bins (mass kept per bin), so the
    estimate ``Σ 1 - (1 - p)^n`` costs ``O(order · bins²)`` for any vocabulary. Real text repeats
    common n-grams far more often than independent tokens do, so it reads fewer distinct n-grams:
    this is an over-estimate (at most ``n_tokens``; exact for order 1).
    """
    if order < 1 or n_tokens < 0:
        raise ValueError(f"need order >= 1 and n_tokens >= 0, got order={order}, n_tokens={n_tokens}")
    if order == 1:
        return unique_rows_estimate(n_tokens, vocab, zipf_s)
    p1 = zipf_probabilities(vocab, zipf_s)
    unit_p, unit_c = _binned(np.log(p1), np.ones(vocab), bins)
    p, c = unit_p, unit_c
    for _ in range(order - 1):
        p, c = _binned(np.log((p[:, None] * unit_p[None, :]).ravel()), (c[:, None] * unit_c[None, :]).ravel(), bins)
    return float((c * -np.expm1(n_tokens * np.log1p(-p))).sum())


def stored_param_count(ckpt_dir) -> int:
    """Values stored in a checkpoint's ``model.safetensors`` (read from the header, no tensor loaded)."""
    from safetensors import safe_open

    from .checkpoint.directory import WEIGHTS_FILE

    with safe_open(str(Path(ckpt_dir) / WEIGHTS_FILE), framework="pt", device="cpu") as f:
        return sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())


# -- one report ------------------------------------------------------------------------------
def hash_moe_match(cfg: ModelConfig) -> dict:
    """Parameters of one Hash-MoE layer (matched expert count) against one STEM layer."""
    moe_name = HashMoEFFN.name
    moe = cfg.replace(ffn=moe_name, n_experts=cfg.n_experts if cfg.ffn == moe_name else None, engram_layers="none")
    stem, hm = sum(ffn_params(cfg, StemFFN.name).values()), ffn_params(moe, moe_name)["weights"]
    return {"n_experts": moe.n_experts, "hash_moe_layer_params": hm, "stem_layer_params": stem,
            "ratio": hm / stem}


def dense_counterpart(cfg: ModelConfig) -> ModelConfig:
    """``cfg`` with every FFN layer dense (no STEM placement, no ``engram_layers``): what ``vs_dense`` compares to."""
    return cfg.replace(ffn=DenseFFN.name, engram_layers="none")


def ngram_summary(cfg: ModelConfig) -> dict | None:
    """The n-gram key settings of a model with n-gram layers (None without): orders, heads, slots, ``K``,
    seed, normalize and which layers are ``ngram``-keyed (``engram`` ones among them)."""
    if not cfg.ngram_layers:
        return None
    from .ffn.ngram import keys_per_position

    return {"orders": list(cfg.ngram_orders), "heads": cfg.ngram_heads,
            "slots": cfg.ngram_slots or cfg.vocab_size, "keys_per_position": keys_per_position(cfg),
            "seed": cfg.ngram_seed, "normalize": cfg.ngram_normalize, "layers": list(cfg.ngram_layers),
            "engram_layers": [i for i, k in enumerate(cfg.layer_kinds) if k == EngramFFN.name]}


def summarize(cfg: ModelConfig, seq_len: int | None = None, dtype_bytes: int = 2) -> dict:
    """Every count above for ``cfg`` (and ratios to its dense counterpart) as one JSON-able dict."""
    seq_len = seq_len or cfg.max_seq_len
    if dtype_bytes <= 0:
        raise ValueError(f"dtype_bytes must be positive, got {dtype_bytes}")
    dense = dense_counterpart(cfg)
    fwd, dense_fwd = forward_flops_per_token(cfg, seq_len), forward_flops_per_token(dense, seq_len)
    return {
        "config": cfg.to_dict(),
        "seq_len": seq_len,
        "dtype_bytes": dtype_bytes,
        "layer_kinds": list(cfg.layer_kinds),
        "stem_layers": list(cfg.stem_layer_ids),
        "table_layers": list(cfg.table_layers),
        "table_rows": {str(i): n for i, n in table_rows_per_layer(cfg).items()},
        "table_rows_per_token": table_rows_per_token(cfg),
        "table_bytes_per_token": table_bytes_per_token(cfg, dtype_bytes),
        "table_sum_adds_per_token": table_sum_adds_per_token(cfg),
        "ngram": ngram_summary(cfg),
        "param_breakdown": param_breakdown(cfg),
        "total_params": total_params(cfg),
        "active_params": active_params(cfg),
        "active_params_embedding_row": active_params(cfg, embedding="row"),
        "flops_per_token_forward": fwd,
        "flops_per_token_forward_causal": forward_flops_per_token(cfg, seq_len, causal=True),
        "flops_per_token_train": train_flops_per_token(cfg, seq_len),
        "flops_per_layer": forward_flops_per_layer(cfg, seq_len),
        "lm_head_flops_per_token": lm_head_flops_per_token(cfg),
        "decode_param_bytes": decode_param_bytes(cfg, dtype_bytes),
        "kv_cache_bytes_per_sequence": kv_cache_bytes(cfg, 1, seq_len, dtype_bytes),
        "saving_fraction_per_stem_layer": saving_fraction(cfg.d_model, cfg.d_ff, seq_len),
        "layer_saving_fraction": layer_saving_fraction(cfg, seq_len),
        "model_flop_saving": 1 - fwd / dense_fwd,
        "vs_dense": {
            "total_params": total_params(cfg) / total_params(dense),
            "active_params": active_params(cfg) / active_params(dense),
            "flops_per_token_forward": fwd / dense_fwd,
            "decode_param_bytes": decode_param_bytes(cfg) / decode_param_bytes(dense),
        },
        "hash_moe_match": hash_moe_match(cfg),
    }


def human(n: float, unit: str = "") -> str:
    """``1498482688`` -> ``'1.50B'`` (K, M, B, T; bytes use the same decimal prefixes)."""
    for scale, suffix in ((1e12, "T"), (1e9, "B" if not unit else "G"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{suffix}{unit}"
    return f"{n:.0f}{unit}" if float(n).is_integer() else f"{n:.3g}{unit}"

