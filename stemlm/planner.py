"""Offload planner: memory and per-step transfers when STEM tables live off the accelerator.

A plan answers, for a model shape, a table tier and a batch: how much accelerator memory the
backbone, a hot-row cache and the KV cache take; how much host (or disk) memory the tables and
their optimizer state take; how many table rows cross the link per step; and whether that
transfer hides under the step's compute. All counts come from ``accounting``.

Model of a step (see docs/accounting.md):

* Every table layer needs the rows of the step's distinct tokens. Tokens are i.i.d. Zipf(s)
  draws over the vocabulary ranks; the cache holds the ``cache_frac · V`` most frequent rows,
  so the rows to move per layer are the expected distinct tokens outside the cache.
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


def _decode_rows_hidden(cfg: ModelConfig, seq_len: int, step_s: float, per_layer_transfer_s: float) -> bool:
    """Rows fetched in layer order from the start of the step; each must arrive before its layer runs."""
    costs = [r["total"] for r in acc.forward_flops_per_layer(cfg, seq_len)]
    total = sum(costs) + acc.lm_head_flops_per_token(cfg)
    for k, layer in enumerate(cfg.table_layers):
        if (k + 1) * per_layer_transfer_s > step_s * sum(costs[:layer]) / total:
            return False
    return True


def step_plan(cfg: ModelConfig, n_tokens: int, seq_len: int, *, tier: str, cache_rows: int, dtype_bytes: int,
              zipf_s: float, hw: Hardware, train: bool, optimizer_bytes: int, decode: bool,
              row_bytes: int | None = None) -> dict:
    """Rows, bytes and times of one step that processes ``n_tokens`` tokens (``row_bytes``: a stored
    table row, default ``d_ff × dtype_bytes``; less for quantized tables)."""
    n_layers_t = len(cfg.table_layers)
    unique = acc.unique_rows_estimate(n_tokens, cfg.vocab_size, zipf_s)
    misses = acc.unique_rows_estimate(n_tokens, cfg.vocab_size, zipf_s, skip_top=cache_rows) if tier != "device" else 0.0
    row_bytes = row_bytes or cfg.d_ff * dtype_bytes
    bytes_in = n_layers_t * misses * row_bytes
    bytes_out = bytes_in if train else 0.0  # gradients of the missed rows go back to their tier
    disk_bytes = 0.0
    if tier == "disk":  # rows (and, when training, their optimizer state) read, then written back
        per_row = row_bytes + (cfg.d_ff * optimizer_bytes if train else 0)
        disk_bytes = n_layers_t * misses * per_row * (2 if train else 1)
    transfer_s = bytes_in / (hw.link_gbps * GB) + disk_bytes / (hw.disk_gbps * GB)
    flops = n_tokens * (acc.forward_flops_per_token(cfg, seq_len, causal=not decode))
    flops *= acc.TRAIN_FLOPS_MULTIPLIER if train else 1
    mem_read = _weights_read_bytes(cfg, n_tokens, dtype_bytes)
    if decode:
        mem_read += acc.kv_cache_bytes(cfg, n_tokens, seq_len, dtype_bytes)
    compute_s, memory_s = flops / hw.flops, mem_read / (hw.mem_gbps * GB)
    step_s = max(compute_s, memory_s)
    if decode and n_layers_t:
        hidden = _decode_rows_hidden(cfg, seq_len, step_s, transfer_s / n_layers_t)
    else:
        hidden = transfer_s <= step_s
    return {
        "tokens": n_tokens, "unique_rows_per_layer": unique, "cache_hits_per_layer": unique - misses,
        "rows_to_move_per_layer": misses, "rows_to_move": n_layers_t * misses,
        "bytes_to_move": bytes_in, "bytes_back": bytes_out, "disk_bytes": disk_bytes,
        "transfer_s": transfer_s, "flops": flops, "compute_s": compute_s, "memory_read_bytes": mem_read,
        "memory_s": memory_s, "step_s": step_s, "transfer_hidden": hidden,
        "transfer_over_step": transfer_s / step_s,
    }


def train_window_bytes(cfg: ModelConfig, n_tokens: int, dtype_bytes: int, optimizer_bytes: int, zipf_s: float) -> float:
    """Accelerator bytes of host-RAM tables in training (``run.tables=host``, ``stemlm.train.fused.host``):
    the rows of two steps (the current window and the next step's staged rows), each row with its
    gradient and optimizer state, for the expected distinct tokens of a step."""
    unique = acc.unique_rows_estimate(n_tokens, cfg.vocab_size, zipf_s)
    return 2 * len(cfg.table_layers) * unique * cfg.d_ff * (2 * dtype_bytes + optimizer_bytes)


def train_bus_bytes(cfg: ModelConfig, n_tokens: int, dtype_bytes: int, optimizer_bytes: int, zipf_s: float,
                    cache_rows: int = 0) -> float:
    """Host <-> accelerator bytes of one training step with host-RAM tables (``run.tables=host``): the
    rows a step uses that the previous step did not (read in: row + optimizer state) and as many rows
    the previous step used that this one does not (written back), for two independent Zipf batches.
    Rows two consecutive steps share stay on the accelerator (the window), which is the cache in front
    of host RAM; with UVA (CUDA) these bytes are read and written by the accelerator's own kernels.
    The ``cache_rows`` most frequent rows (``run.table_cache_rows``) stay on the accelerator: never moved."""
    p = acc.zipf_probabilities(cfg.vocab_size, zipf_s)[cache_rows:]  # rank order: the cached rows first
    seen = 1 - (1 - p) ** n_tokens  # P(row used by a step)
    fresh = float((seen * (1 - seen)).sum())  # E[rows in this step, not in the previous]
    per_row = len(cfg.table_layers) * cfg.d_ff * (dtype_bytes + optimizer_bytes)
    return 2 * fresh * per_row


def plan(cfg: ModelConfig, *, tables: str = "host", cache_frac: float = 0.0, batch: int = 1,
         seq_len: int | None = None, dtype_bytes: int = 2, train: bool = False, zipf_s: float = 1.0,
         optimizer_bytes: int = 8, hardware: Hardware = Hardware(), table_dtype: str | None = None) -> dict:
    """Memory per tier and per-step transfers for decode and for prefill (or training).

    ``optimizer_bytes`` is optimizer state per trained value (8: Adam's two fp32 moments).
    ``table_dtype`` (``bf16``, ``int8``, ``int4``; inference only) stores the tables quantized
    (``stemlm.model.quant``): fewer bytes stored and moved per row; the row cache holds decoded rows.
    Activations are not modelled.
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
    cache_rows = round(cache_frac * cfg.vocab_size) if tables != "device" else cfg.vocab_size
    n_layers_t = len(cfg.table_layers)
    table_value_bytes = dtype_bytes + (optimizer_bytes if train else 0)
    backbone = sum(parts.values()) - parts["tables"]
    accel = {"backbone_weights": backbone * dtype_bytes,
             "row_cache": n_layers_t * cache_rows * cfg.d_ff * table_value_bytes}
    if train:
        accel["backbone_grads_and_optimizer"] = backbone * (dtype_bytes + optimizer_bytes)
        window = train_window_bytes(cfg, batch * seq_len, dtype_bytes, optimizer_bytes, zipf_s)
        if tables != "device":
            accel["step_window"] = window
    else:
        accel["kv_cache"] = acc.kv_cache_bytes(cfg, batch, seq_len, dtype_bytes)
    stored = n_layers_t * cfg.vocab_size * row_bytes + (parts["tables"] * optimizer_bytes if train else 0)
    if tables == "device" and table_dtype:  # quantized tables resident on the accelerator, decoded on gather
        accel["row_cache"] = n_layers_t * cfg.vocab_size * row_bytes
    off = {"tables": stored if tables != "device" else 0}
    common = dict(tier=tables, cache_rows=cache_rows, dtype_bytes=dtype_bytes, zipf_s=zipf_s, hw=hardware,
                  train=train, optimizer_bytes=optimizer_bytes, row_bytes=row_bytes)
    steps = {"train" if train else "prefill": step_plan(cfg, batch * seq_len, seq_len, decode=False, **common)}
    if not train:
        steps["decode"] = step_plan(cfg, batch, seq_len, decode=True, **common)
    train_memory = None
    if train:  # the accelerator with the tables trained on it, and with run.tables=host (no cache)
        base = accel["backbone_weights"] + accel["backbone_grads_and_optimizer"]
        host_cache = round(cache_frac * cfg.vocab_size)
        bus = train_bus_bytes(cfg, batch * seq_len, dtype_bytes, optimizer_bytes, zipf_s, host_cache)
        train_memory = {"device": base + n_layers_t * cfg.vocab_size * cfg.d_ff * table_value_bytes,
                        "host": base + window + n_layers_t * host_cache * cfg.d_ff * table_value_bytes,
                        "host_cache_rows": host_cache, "host_bus_bytes_per_step": bus,
                        "host_bus_s_per_step": bus / (hardware.link_gbps * 1e9)}
    return {
        "config": cfg.to_dict(), "tables": tables, "train_memory": train_memory, "cache_frac": cache_frac, "cache_rows": cache_rows,
        "batch": batch, "seq_len": seq_len, "dtype_bytes": dtype_bytes, "train": train, "zipf_s": zipf_s,
        "optimizer_bytes": optimizer_bytes, "hardware": dataclasses.asdict(hardware),
        "table_layers": list(cfg.table_layers), "row_bytes": row_bytes, "table_dtype": table_dtype,
        "accelerator_bytes": {**accel, "total": sum(accel.values())},
        "host_bytes": {"tables_and_state": off["tables"] if tables == "host" else 0},
        "disk_bytes": {"tables_and_state": off["tables"] if tables == "disk" else 0},
        "steps": steps,
    }
