"""Offload planner: memory and per-step transfers when STEM tables live off the accelerator.

A plan answers, for a model shape, a table tier and a batch: how much accelerator memory the
backbone, a hot-row cache and the KV cache take; how much host (or disk) memory the tables and
their optimizer state take; how many table rows cross the link per step; and whether that
transfer hides under the step's compute. All counts come from ``accounting``.

Model of a step (see docs/accounting.md):

* Every table layer needs the rows of the step's distinct keys. Tokens are i.i.d. Zipf(s)
  draws over the vocabulary ranks; the cache holds the ``cache_frac · rows`` most used rows of
  each table, so the rows to move per layer are the expected distinct keys outside the cache.
  A token-keyed table (``V`` rows) is keyed by the tokens themselves: its distinct keys are the
  step's distinct tokens.
* An n-gram table (``ngram_slots = S`` rows, ``stemlm.ffn.ngram``) is read at K keys per position:
  the token (rows ``0..V-1``) and ``heads`` hashed slots of each order's n-gram. The approximation
  (``row_use``): the n-grams are those of independent Zipf tokens (``accounting.distinct_ngrams_estimate``;
  real text repeats common n-grams much more, so this over-estimates the distinct n-grams and the rows
  moved, towards the bound of every n-gram distinct), each distinct n-gram's ``heads`` slots are
  independent and uniform over the S slots (what the hash is built to do), and the first ``n - 1``
  positions of a sequence (whose n-grams hash the padding) count as ordinary n-grams. A row is used
  when a token or a hash reaches it: ``P(token row j) = 1 - (1 - p_j)^N q`` and ``P(other row) =
  1 - q`` with ``q = (1 - 1/S)^M``, ``M = heads · Σ_n D_n`` hashed keys of ``D_n`` distinct n-grams.
  The cache holds the most used rows: the frequent token rows first.
* Decode moves ``batch`` tokens per step at context ``seq_len``; prefill/training moves
  ``batch × seq_len`` tokens. Training also sends the missed rows' gradients back (the link is
  full duplex, so this does not add time) and updates cached rows on the accelerator.
* Step time is ``max(FLOPs / flops, bytes read / mem_gbps)``. Prefill/training know the next
  batch's ids a step ahead, so the transfer hides if it fits in one step. Decode learns its ids
  at the start of the step: rows are fetched layer by layer in order and hide only if each table
  layer's rows arrive before that layer starts (layers take time in proportion to their FLOPs).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from . import accounting as acc
from .layered_config import parse_overrides
from .config import ConfigError, ModelConfig
from .ffn import ffn_kind
from .model.quant import RowCodec
from .presets import PRESETS, model_config
from .store.tiers import tier_of

# Shapes used only for planning (too large to build on CPU); combine with any ffn / placement.
EXTRA_SHAPES: dict[str, dict] = {
    "7b-class": dict(d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, d_ff=14336, vocab_size=128256,
                     rope_theta=500000.0, max_seq_len=8192),
}
GB = 1e9


@dataclass(frozen=True)
class Hardware:
    """Throughputs of the machine being planned for (effective, not peak)."""

    link_gbps: float = 25.0  # host <-> accelerator, GB/s (PCIe 4.0 x16 effective)
    disk_gbps: float = 5.0  # NVMe -> host, GB/s (tables on disk)
    flops: float = 100e12  # accelerator matmul FLOP/s
    mem_gbps: float = 1500.0  # accelerator memory bandwidth, GB/s

    def __post_init__(self):
        for f in dataclasses.fields(self):
            if getattr(self, f.name) <= 0:
                raise ValueError(f"{f.name} must be positive, got {getattr(self, f.name)}")


def preset_names() -> list[str]:
    """Presets of ``presets.py`` plus the planning-only shapes."""
    return [*PRESETS, *EXTRA_SHAPES]


def resolve_model_config(preset: str = "debug", ffn: str | None = None, stem_layers: str | None = None,
                         overrides: list[str] | tuple[str, ...] = ()) -> ModelConfig:
    """A preset (or planning shape), then ``ffn`` / ``stem_layers``, then ``model.FIELD=VALUE`` items."""
    fields: dict = {}
    if ffn is not None:
        fields["ffn"] = ffn
    if stem_layers is not None:
        fields["stem_layers"] = stem_layers
    parsed = parse_overrides(list(overrides))
    other = sorted(k for k in parsed if k != "model")
    if other or not isinstance(parsed.get("model", {}), dict):
        raise ConfigError(f"only model.FIELD=VALUE overrides are valid here, got {other[0] if other else 'model'!r}")
    fields.update(parsed.get("model", {}))
    if preset in EXTRA_SHAPES:
        return ModelConfig.from_dict({**EXTRA_SHAPES[preset], **fields})
    if preset not in PRESETS:
        raise ConfigError(f"unknown preset {preset!r}; choose one of {', '.join(preset_names())}")
    return model_config(preset, **fields)


def _weights_read_bytes(cfg: ModelConfig, n_tokens: float, dtype_bytes: int) -> float:
    """Backbone bytes one step reads: dense weights, LM head, embedding rows, the FFN weights each kind
    reads for ``n_tokens`` tokens (a Hash-MoE layer: the experts they touch)."""
    parts = acc.param_breakdown(cfg)
    read = sum(parts.values()) - parts["tables"] - parts["ffn_weights"]
    if not cfg.tie_embeddings:
        read -= parts["embedding"] - min(n_tokens, cfg.vocab_size) * cfg.d_model
    read += sum(ffn_kind(k).weights_read(cfg, n_tokens) for k in cfg.layer_kinds)
    return read * dtype_bytes


@dataclass(frozen=True)
class RowUse:
    """How likely one step is to use each row of one table, rows ranked most used first: ``head`` for the
    ``V`` token rows (Zipf rank order), then ``tail_rows`` further rows (an n-gram table's slots past the
    token rows) of probability ``tail_p`` each."""

    head: np.ndarray
    tail_rows: int = 0
    tail_p: float = 0.0

    @property
    def rows(self) -> int:
        """Rows of the table."""
        return len(self.head) + self.tail_rows

    def distinct(self, skip: int = 0) -> float:
        """Expected distinct rows the step uses outside the ``skip`` most used (a cache of those rows)."""
        if skip <= len(self.head):
            return float(self.head[skip:].sum()) + self.tail_rows * self.tail_p
        return max(self.tail_rows - (skip - len(self.head)), 0) * self.tail_p

    def fresh(self, skip: int = 0) -> float:
        """Expected rows outside the ``skip`` most used that a step uses and an independent previous step
        did not: ``Σ P(1 - P)``."""
        head = self.head[min(skip, len(self.head)):]
        tail = max(self.tail_rows - max(skip - len(self.head), 0), 0)
        return float((head * (1 - head)).sum()) + tail * self.tail_p * (1 - self.tail_p)


def row_use(cfg: ModelConfig, layer: int, n_tokens: float, zipf_s: float) -> RowUse:
    """``RowUse`` of table layer ``layer`` in a step of ``n_tokens`` i.i.d. Zipf tokens (module docstring:
    token keys exactly; n-gram keys under the stated approximation)."""
    kind = ffn_kind(cfg.layer_kinds[layer])
    log_miss = n_tokens * np.log1p(-acc.zipf_probabilities(cfg.vocab_size, zipf_s))  # log P(token j absent)
    if kind.keyed_by == "token":
        return RowUse(-np.expm1(log_miss))
    slots = cfg.table_rows(layer)
    hashed = cfg.ngram_heads * sum(acc.distinct_ngrams_estimate(n_tokens, cfg.vocab_size, n, zipf_s)
                                   for n in cfg.ngram_orders)
    log_q = hashed * np.log1p(-1 / slots)  # log P(no hashed key lands on a given row)
    return RowUse(-np.expm1(log_miss + log_q), slots - cfg.vocab_size, float(-np.expm1(log_q)))


def ngram_note(cfg: ModelConfig) -> str | None:
    """One line stating how the plan models n-gram keys (None for a model without n-gram tables)."""
    if not cfg.ngram_layers:
        return None
    from .ffn.ngram import keys_per_position

    return (f"n-gram tables (layers {', '.join(map(str, cfg.ngram_layers))}): K = {keys_per_position(cfg)} keys/position "
            f"(token + {cfg.ngram_heads} hash heads x orders {','.join(map(str, cfg.ngram_orders))}) over "
            f"{cfg.ngram_slots or cfg.vocab_size} slots; distinct rows = the step's tokens plus the hashed slots of its "
            "distinct n-grams, taken as n-grams of independent Zipf tokens (an over-estimate: real text repeats "
            "n-grams more) hashed uniformly")


def _decode_rows_hidden(cfg: ModelConfig, seq_len: int, step_s: float, transfer_s_of: dict[int, float]) -> bool:
    """Rows fetched in layer order from the start of the step (``transfer_s_of``: seconds per table
    layer); each layer's rows must arrive before it runs."""
    costs = [r["total"] for r in acc.forward_flops_per_layer(cfg, seq_len)]
    total = sum(costs) + acc.lm_head_flops_per_token(cfg)
    arrived = 0.0
    for layer in cfg.table_layers:
        arrived += transfer_s_of[layer]
        if arrived > step_s * sum(costs[:layer]) / total:
            return False
    return True


def _cache_rows_of(cfg: ModelConfig, cache_rows: int | dict[int, int]) -> dict[int, int]:
    """Rows cached per table layer: one count for every table, or a count per layer."""
    if isinstance(cache_rows, dict):
        return {i: cache_rows[i] for i in cfg.table_layers}
    return {i: cache_rows for i in cfg.table_layers}


def step_plan(cfg: ModelConfig, n_tokens: int, seq_len: int, *, tier: str, cache_rows: int | dict[int, int],
              dtype_bytes: int, zipf_s: float, hw: Hardware, train: bool, optimizer_bytes: int, decode: bool,
              row_bytes: int | None = None) -> dict:
    """Rows, bytes and times of one step that processes ``n_tokens`` tokens (``cache_rows``: rows cached
    of every table, or per table layer; ``row_bytes``: a stored table row, default ``d_ff × dtype_bytes``;
    less for quantized tables). ``*_per_layer`` values are means over the table layers; ``layers`` has
    each layer's own."""
    n_layers_t = len(cfg.table_layers)
    cached = _cache_rows_of(cfg, cache_rows)
    layers = {}
    for i in cfg.table_layers:
        use = row_use(cfg, i, n_tokens, zipf_s)
        unique_i = use.distinct()
        layers[i] = {"kind": cfg.layer_kinds[i], "table_rows": use.rows, "keys_per_token": ffn_kind(cfg.layer_kinds[i]).rows_per_token(cfg),
                     "unique_rows": unique_i, "rows_to_move": use.distinct(cached[i]) if tier != "device" else 0.0}
    unique = sum(r["unique_rows"] for r in layers.values())
    misses = sum(r["rows_to_move"] for r in layers.values())
    row_bytes = row_bytes or cfg.d_ff * dtype_bytes
    bytes_in = misses * row_bytes
    bytes_out = bytes_in if train else 0.0  # gradients of the missed rows go back to their tier
    disk_bytes = 0.0
    per_row = row_bytes + (cfg.d_ff * optimizer_bytes if train else 0)
    if tier == "disk":  # rows (and, when training, their optimizer state) read, then written back
        disk_bytes = misses * per_row * (2 if train else 1)
    transfer_s = bytes_in / (hw.link_gbps * GB) + disk_bytes / (hw.disk_gbps * GB)
    for r in layers.values():  # each layer's share of the transfer
        r["transfer_s"] = transfer_s * r["rows_to_move"] / misses if misses else 0.0
    flops = n_tokens * (acc.forward_flops_per_token(cfg, seq_len, causal=not decode))
    flops *= acc.TRAIN_FLOPS_MULTIPLIER if train else 1
    mem_read = _weights_read_bytes(cfg, n_tokens, dtype_bytes)
    if decode:
        mem_read += acc.kv_cache_bytes(cfg, n_tokens, seq_len, dtype_bytes)
    compute_s, memory_s = flops / hw.flops, mem_read / (hw.mem_gbps * GB)
    step_s = max(compute_s, memory_s)
    if decode and n_layers_t:
        hidden = _decode_rows_hidden(cfg, seq_len, step_s, {i: r["transfer_s"] for i, r in layers.items()})
    else:
        hidden = transfer_s <= step_s
    mean = (lambda x: x / n_layers_t) if n_layers_t else (lambda x: 0.0)  # noqa: E731
    return {
        "tokens": n_tokens, "unique_rows_per_layer": mean(unique), "cache_hits_per_layer": mean(unique - misses),
        "rows_to_move_per_layer": mean(misses), "rows_to_move": misses,
        "layers": {str(i): r for i, r in layers.items()},
        "bytes_to_move": bytes_in, "bytes_back": bytes_out, "disk_bytes": disk_bytes,
        "transfer_s": transfer_s, "flops": flops, "compute_s": compute_s, "memory_read_bytes": mem_read,
        "memory_s": memory_s, "step_s": step_s, "transfer_hidden": hidden,
        "transfer_over_step": transfer_s / step_s,
    }


def train_window_bytes(cfg: ModelConfig, n_tokens: int, dtype_bytes: int, optimizer_bytes: int, zipf_s: float) -> float:
    """Accelerator bytes of host-RAM tables in training (``run.tables=host``, ``stemlm.train.fused.host``):
    the rows of two steps (the current window and the next step's staged rows), each row with its
    gradient and optimizer state, for the expected distinct keys of a step in every table (``row_use``:
    the distinct tokens of a token-keyed table, tokens and hashed n-gram slots of an n-gram table)."""
    unique = sum(row_use(cfg, i, n_tokens, zipf_s).distinct() for i in cfg.table_layers)
    return 2 * unique * cfg.d_ff * (2 * dtype_bytes + optimizer_bytes)


def train_bus_bytes(cfg: ModelConfig, n_tokens: int, dtype_bytes: int, optimizer_bytes: int, zipf_s: float,
                    cache_rows: int = 0) -> float:
    """Host <-> accelerator bytes of one training step with host-RAM tables (``run.tables=host``): the
    rows a step uses that the previous step did not (read in: row + optimizer state) and as many rows
    the previous step used that this one does not (written back), for two independent Zipf batches
    (``row_use`` per table: n-gram tables under its approximation).
    Rows two consecutive steps share stay on the accelerator (the window), which is the cache in front
    of host RAM; with UVA (CUDA) these bytes are read and written by the accelerator's own kernels.
    The ``cache_rows`` most frequent token rows of every table (``run.table_cache_rows``: the hot token
    ids, rows ``0..V-1`` of an n-gram table too) stay on the accelerator: never moved."""
    fresh = sum(row_use(cfg, i, n_tokens, zipf_s).fresh(min(cache_rows, cfg.vocab_size)) for i in cfg.table_layers)
    return 2 * fresh * cfg.d_ff * (dtype_bytes + optimizer_bytes)


def plan(cfg: ModelConfig, *, tables: str = "host", cache_frac: float = 0.0, batch: int = 1,
         seq_len: int | None = None, dtype_bytes: int = 2, train: bool = False, zipf_s: float = 1.0,
         optimizer_bytes: int = 8, hardware: Hardware = Hardware(), table_dtype: str | None = None) -> dict:
    """Memory per tier and per-step transfers for decode and for prefill (or training).

    ``optimizer_bytes`` is optimizer state per trained value (8: Adam's two fp32 moments).
    ``table_dtype`` (``bf16``, ``int8``, ``int4``; inference only) stores the tables quantized
    (``stemlm.model.quant``): fewer bytes stored and moved per row; the row cache holds decoded rows.
    Activations are not modelled.

    ``cache_frac`` of every table's rows are cached (an n-gram table: of its ``ngram_slots`` rows);
    ``cache_rows`` is the rows cached per table, None when the tables differ in rows (a STEM model with an
    ``engram`` layer of more slots): ``cache_rows_per_layer`` has each one's. Rows moved per step are the
    distinct keys of its tokens outside the cache (module docstring; ``ngram_model`` states the
    approximation used for n-gram tables).
    """
    seq_len = seq_len or cfg.max_seq_len
    tier_of(tables)
    if not 0 <= cache_frac <= 1:
        raise ValueError(f"cache_frac must be in [0, 1], got {cache_frac}")
    if batch <= 0 or seq_len <= 0 or dtype_bytes <= 0 or optimizer_bytes < 0:
        raise ValueError("batch, seq_len and dtype_bytes must be positive, optimizer_bytes >= 0")
    if table_dtype is not None and RowCodec(table_dtype).quantized and train:
        raise ValueError(f"{table_dtype} tables are for inference; plan training with plain rows (--dtype-bytes)")
    row_bytes = RowCodec(table_dtype).row_bytes(cfg.d_ff) if table_dtype else cfg.d_ff * dtype_bytes
    parts = acc.param_breakdown(cfg)
    rows_of = acc.table_rows_per_layer(cfg)  # V, or ngram_slots for an n-gram table
    all_rows = sum(rows_of.values())
    cached = {i: round(cache_frac * n) if tables != "device" else n for i, n in rows_of.items()}
    cache_rows = next(iter(cached.values())) if len(set(cached.values())) == 1 else \
        (None if cached else round(cache_frac * cfg.vocab_size))  # per table; None when the tables differ
    table_value_bytes = dtype_bytes + (optimizer_bytes if train else 0)
    backbone = sum(parts.values()) - parts["tables"]
    accel = {"backbone_weights": backbone * dtype_bytes,
             "row_cache": sum(cached.values()) * cfg.d_ff * table_value_bytes}
    if train:
        accel["backbone_grads_and_optimizer"] = backbone * (dtype_bytes + optimizer_bytes)
        window = train_window_bytes(cfg, batch * seq_len, dtype_bytes, optimizer_bytes, zipf_s)
        if tables != "device":
            accel["step_window"] = window
    else:
        accel["kv_cache"] = acc.kv_cache_bytes(cfg, batch, seq_len, dtype_bytes)
    stored = all_rows * row_bytes + (parts["tables"] * optimizer_bytes if train else 0)
    if tables == "device" and table_dtype:  # quantized tables resident on the accelerator, decoded on gather
        accel["row_cache"] = all_rows * row_bytes
    off = {"tables": stored if tables != "device" else 0}
    common = dict(tier=tables, cache_rows=cached, dtype_bytes=dtype_bytes, zipf_s=zipf_s, hw=hardware,
                  train=train, optimizer_bytes=optimizer_bytes, row_bytes=row_bytes)
    steps = {"train" if train else "prefill": step_plan(cfg, batch * seq_len, seq_len, decode=False, **common)}
    if not train:
        steps["decode"] = step_plan(cfg, batch, seq_len, decode=True, **common)
    train_memory = None
    if train:  # the accelerator with the tables trained on it, and with run.tables=host (no cache)
        base = accel["backbone_weights"] + accel["backbone_grads_and_optimizer"]
        host_cache = round(cache_frac * cfg.vocab_size)  # run.table_cache_rows: hot token ids, cached in every table
        bus = train_bus_bytes(cfg, batch * seq_len, dtype_bytes, optimizer_bytes, zipf_s, host_cache)
        train_memory = {"device": base + all_rows * cfg.d_ff * table_value_bytes,
                        "host": base + window + len(rows_of) * host_cache * cfg.d_ff * table_value_bytes,
                        "host_cache_rows": host_cache, "host_bus_bytes_per_step": bus,
                        "host_bus_s_per_step": bus / (hardware.link_gbps * 1e9)}
    return {
        "config": cfg.to_dict(), "tables": tables, "train_memory": train_memory, "cache_frac": cache_frac, "cache_rows": cache_rows,
        "cache_rows_per_layer": {str(i): n for i, n in cached.items()},
        "table_rows": {str(i): n for i, n in rows_of.items()}, "table_rows_per_token": acc.table_rows_per_token(cfg),
        "ngram": acc.ngram_summary(cfg), "ngram_model": ngram_note(cfg),
        "batch": batch, "seq_len": seq_len, "dtype_bytes": dtype_bytes, "train": train, "zipf_s": zipf_s,
        "optimizer_bytes": optimizer_bytes, "hardware": dataclasses.asdict(hardware),
        "table_layers": list(cfg.table_layers), "row_bytes": row_bytes, "table_dtype": table_dtype,
        "accelerator_bytes": {**accel, "total": sum(accel.values())},
        "host_bytes": {"tables_and_state": off["tables"] if tables == "host" else 0},
        "disk_bytes": {"tables_and_state": off["tables"] if tables == "disk" else 0},
        "steps": steps,
    }
