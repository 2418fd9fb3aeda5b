"""Memory and transfer plan for STEM tables kept in host RAM or on disk.

Prints accelerator memory (backbone, hot-row cache, KV cache), host/disk memory (tables, plus
optimizer state with --train), the table rows and bytes moved per step under a Zipf token law
(the cache holds the most frequent rows), and whether the transfer hides under the step's compute,
for decode (batch tokens per step) and for prefill or training (batch x seq tokens per step).
Model and assumptions: stemlm/planner.py and docs/accounting.md. A model with n-gram tables (ffn
ngram / ngram_dagger / engram, or model.engram_layers) reads K rows per position from tables of
model.ngram_slots rows: rows moved are the distinct keys of a step (its tokens plus the hashed slots
of its n-grams, estimated as n-grams of independent Zipf tokens: an over-estimate for real text).

Examples:
  stemlm plan --preset 7b-class --tables host --cache-frac 0.05 --batch 8 --seq 4096
  stemlm plan --preset llama3.2-1b --tables disk --train --batch 16 --seq 2048 --json
  stemlm plan --preset 7b-class --ffn ngram model.ngram_slots=512000 --cache-frac 0.05 --batch 8 --seq 4096
"""

from __future__ import annotations

import argparse
import json

from ..accounting import human
from ..ffn import FFN_KINDS
from ..planner import Hardware, plan, preset_names, resolve_model_config
from ..store.tiers import TIERS
from ..model.quant import TABLE_DTYPES
from .options import fraction, non_empty, non_negative_int, positive_float, positive_int


def add_arguments(parser: argparse.ArgumentParser) -> None:
    hw = Hardware()
    parser.add_argument("--preset", default="debug", choices=preset_names(), help="model shape (default: debug)")
    parser.add_argument("--ffn", default="stem", choices=FFN_KINDS, help="FFN kind of the chosen layers (default: stem)")
    parser.add_argument("--stem-layers", type=non_empty, default=None, help="placement: '1/3', '1/2', 'full', 'none' or '2,5'")
    parser.add_argument("--tables", default="host", choices=TIERS, help="where the tables live (default: host)")
    parser.add_argument("--cache-frac", type=fraction, default=0.0, help="fraction of each table's rows cached on the accelerator, most frequent first")
    parser.add_argument("--batch", type=positive_int, default=1, help="sequences per step (default: 1)")
    parser.add_argument("--seq", type=positive_int, default=None, help="sequence length / decode context (default: max_seq_len)")
    parser.add_argument("--train", action="store_true", help="plan a training step (gradients back, optimizer state)")
    parser.add_argument("--dtype-bytes", type=positive_int, default=2, help="bytes per value of weights, rows and KV (default: 2)")
    parser.add_argument("--table-dtype", choices=TABLE_DTYPES, default=None,
                        help="store the tables as fp32, bf16, int8 or int4 (inference; default: --dtype-bytes per value)")
    parser.add_argument("--optimizer-bytes", type=non_negative_int, default=8, help="optimizer state bytes per trained value (default: 8, Adam fp32 moments)")
    parser.add_argument("--zipf-s", type=positive_float, default=1.0, help="exponent of the Zipf law of token frequencies (default: 1.0)")
    parser.add_argument("--link-gbps", type=positive_float, default=hw.link_gbps, help=f"host-accelerator bandwidth in GB/s (gigabytes; default {hw.link_gbps}: PCIe 4.0 x16 effective)")
    parser.add_argument("--disk-gbps", type=positive_float, default=hw.disk_gbps, help=f"disk read bandwidth in GB/s (default {hw.disk_gbps})")
    parser.add_argument("--flops", type=positive_float, default=hw.flops, help=f"accelerator matmul FLOP/s (default {hw.flops:.0e})")
    parser.add_argument("--mem-gbps", type=positive_float, default=hw.mem_gbps, help=f"accelerator memory bandwidth in GB/s (default {hw.mem_gbps})")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("overrides", nargs="*", metavar="model.FIELD=VALUE", help="override model config fields")


def run(args) -> int:
    cfg = resolve_model_config(args.preset, args.ffn, args.stem_layers, args.overrides)
    hw = Hardware(link_gbps=args.link_gbps, disk_gbps=args.disk_gbps, flops=args.flops, mem_gbps=args.mem_gbps)
    result = plan(cfg, tables=args.tables, cache_frac=args.cache_frac, batch=args.batch, seq_len=args.seq,
                  dtype_bytes=args.dtype_bytes, train=args.train, zipf_s=args.zipf_s,
                  optimizer_bytes=args.optimizer_bytes, hardware=hw, table_dtype=args.table_dtype)
    result = {"preset": args.preset, **result}
    print(json.dumps(result, indent=2) if args.json else format_plan(result))
    return 0


def _ms(seconds: float) -> str:
    return f"{1e3 * seconds:.3f} ms"


def _grouped(values: dict) -> dict:
    """``{layer: value}`` -> ``{value: [layers]}`` (first appearance order)."""
    out: dict = {}
    for layer, value in values.items():
        out.setdefault(value, []).append(layer)
    return out


def _layers(layers: list) -> str:
    return f"layer{'s' if len(layers) > 1 else ''} {','.join(map(str, layers))}"


def format_plan(p: dict) -> str:
    """Readable summary of a ``planner.plan`` result."""
    c = p["config"]
    per_layer = p.get("cache_rows_per_layer") or {}
    cache = f"{p['cache_rows']} rows/table" if p["cache_rows"] is not None else \
        "rows/table " + ", ".join(f"layer {i} {n}" for i, n in per_layer.items())
    where = "tables on device (every row resident)" if p["tables"] == "device" else \
        f"tables on {p['tables']}, cache {100 * p['cache_frac']:.1f}% ({cache})"
    rows = p.get("table_rows") or {}
    lines = [
        f"preset {p['preset']}: ffn {c['ffn']}, {len(p['table_layers'])} table layers {p['table_layers']}, {where}, "
        f"batch {p['batch']} x {p['seq_len']}, {'training' if p['train'] else 'inference'}",
        f"row = {c['d_ff']} values = {human(p['row_bytes'], 'B')}"
        + (f" stored as {p['table_dtype']}" if p.get("table_dtype") else "") + f"; tokens ~ Zipf(s={p['zipf_s']}) over {c['vocab_size']} ids",
        *([f"table rows: " + ", ".join(f"{_layers(ls)} {n}" for n, ls in _grouped(rows).items())
           + f"; {p['table_rows_per_token']} rows read per token", p["ngram_model"]] if p.get("ngram_model") else []),
        "",
        "accelerator memory: " + ", ".join(f"{k} {human(v, 'B')}" for k, v in p["accelerator_bytes"].items()),
        f"host memory: tables{' + optimizer state' if p['train'] else ''} {human(p['host_bytes']['tables_and_state'], 'B')}",
        *([f"training accelerator memory: tables + optimizer state on the accelerator {human(p['train_memory']['device'], 'B')}; "
           f"in host RAM (run.tables=host: rows of two steps on the accelerator"
           f"{', plus a cache of the %d most frequent rows (run.table_cache_rows)' % p['train_memory']['host_cache_rows'] if p['train_memory']['host_cache_rows'] else ''}"
           f") {human(p['train_memory']['host'], 'B')}",
           f"host-RAM tables move {human(p['train_memory']['host_bus_bytes_per_step'], 'B')} per step across the bus "
           f"(rows the previous step lacked in, rows this step drops out; read and written by the accelerator itself "
           f"through UVA on CUDA): {1e3 * p['train_memory']['host_bus_s_per_step']:.1f} ms at {p['hardware']['link_gbps']:g} GB/s"]
          if p.get("train_memory") else []),
        f"disk: tables{' + optimizer state' if p['train'] else ''} {human(p['disk_bytes']['tables_and_state'], 'B')}",
    ]
    for name, s in p["steps"].items():
        lines += [
            "",
            f"{name}: {s['tokens']} tokens/step -> {s['unique_rows_per_layer']:.1f} distinct rows/layer, "
            f"{s['cache_hits_per_layer']:.1f} cache hits, {s['rows_to_move_per_layer']:.1f} to move "
            f"({s['rows_to_move']:.1f} rows, {human(s['bytes_to_move'], 'B')} per step"
            + (f", {human(s['disk_bytes'], 'B')} disk traffic" if s["disk_bytes"] else "") + ")",
            f"  transfer {_ms(s['transfer_s'])} vs step {_ms(s['step_s'])} (compute {_ms(s['compute_s'])}, "
            f"memory {_ms(s['memory_s'])}): {'hidden' if s['transfer_hidden'] else 'NOT hidden'} "
            f"(transfer/step = {s['transfer_over_step']:.3f})",
        ]
        if p.get("ngram_model"):  # n-gram tables: each kind of table layer's own rows
            same = _grouped({i: (r["kind"], r["keys_per_token"], r["table_rows"], round(r["unique_rows"], 6),
                                 round(r["rows_to_move"], 6)) for i, r in s.get("layers", {}).items()})
            lines += [f"  {_layers(ls)} ({kind}, {keys} keys/token, {rows} rows): {unique:.1f} distinct rows, "
                      f"{move:.1f} to move{' each' if len(ls) > 1 else ''}" for (kind, keys, rows, unique, move), ls in same.items()]
    return "\n".join(lines)
