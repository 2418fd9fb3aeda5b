"""Parameters, FLOPs, decode bytes and STEM layer placement of a model shape or a checkpoint.

Counts follow stemlm/accounting.py (docs/accounting.md): matmul FLOPs only (2 per MAC), attention
at the full-L convention, training = 3 x forward, tables counted in total parameters (table rows x
d_ff each) and the rows a token reads in active parameters: one per token-keyed table, K per n-gram
table (input embedding counted whole, as in the paper's Table 3). A model with n-gram layers (ffn
ngram / ngram_dagger / engram, or model.engram_layers) also shows its n-gram keys: orders, hash
heads, slots, K = 1 + orders x heads rows per position, seed and normalisation.

Examples:
  stemlm info --preset llama3.2-1b --seq-len 4096
  stemlm info --preset debug --ffn hash_moe --stem-layers 1/2 model.vocab_size=1024 --json
  stemlm info --preset debug --ffn ngram model.ngram_slots=2048 model.ngram_heads=4
  stemlm info --preset debug --ffn stem model.engram_layers=1
  stemlm info --ckpt runs/debug
"""

from __future__ import annotations

import argparse
import json

from ..accounting import human, summarize
from ..ffn import FFN_KINDS
from .options import add_checkpoint_argument, non_empty, positive_int


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ..planner import preset_names

    parser.add_argument("--preset", default=None, choices=preset_names(), help="model shape (default: debug)")
    parser.add_argument("--ffn", default=None, choices=FFN_KINDS, help="FFN kind of the chosen layers (default: stem)")
    parser.add_argument("--stem-layers", type=non_empty, default=None, help="placement: '1/3', '1/2', 'full', 'none' or '2,5' (default: the config's)")
    parser.add_argument("--seq-len", type=positive_int, default=None, help="sequence length L for attention FLOPs (default: max_seq_len)")
    parser.add_argument("--dtype-bytes", type=positive_int, default=2, help="bytes per parameter value for decode bytes (default: 2, bf16)")
    add_checkpoint_argument(parser, required=False,
                            help="describe a checkpoint (or a run's newest checkpoint) instead of a preset")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    parser.add_argument("overrides", nargs="*", metavar="model.FIELD=VALUE", help="override model config fields")


def _config(args):
    if args.ckpt is None:
        from ..planner import resolve_model_config

        return resolve_model_config(args.preset or "debug", args.ffn or "stem", args.stem_layers, args.overrides), \
            args.preset or "debug", None
    if args.preset or args.ffn or args.stem_layers or args.overrides:
        raise ValueError("--ckpt describes a saved model: do not combine it with --preset, --ffn, --stem-layers or overrides")
    from ..accounting import stored_param_count
    from ..checkpoint.directory import read_config, resolve_checkpoint

    ckpt = resolve_checkpoint(args.ckpt)
    return read_config(ckpt), None, {"path": str(ckpt), "stored_params": stored_param_count(ckpt)}


def run(args) -> int:
    cfg, preset, ckpt = _config(args)
    report = {"preset": preset, **summarize(cfg, args.seq_len, args.dtype_bytes)}
    if ckpt:
        report["checkpoint"] = ckpt
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _ngram_lines(r: dict) -> list[str]:
    """The n-gram key settings and each table's rows (nothing for a model without n-gram layers)."""
    ng = r.get("ngram")
    if not ng:
        return []
    kinds = r["layer_kinds"]
    per_layer = ", ".join(f"{i} {kinds[int(i)]} {n} rows" for i, n in r["table_rows"].items())
    return [f"n-gram keys: orders {','.join(map(str, ng['orders']))}, {ng['heads']} hash heads/order, "
            f"K = {ng['keys_per_position']} rows/position (token + {ng['keys_per_position'] - 1} hashed), "
            f"{ng['slots']} slots/table, seed {ng['seed']}, normalize {'on' if ng['normalize'] else 'off'}; "
            f"n-gram layers {','.join(map(str, ng['layers']))}",
            f"tables: {per_layer}"]


def format_report(r: dict) -> str:
    """Readable tables for a ``summarize`` report."""
    c = r["config"]
    source = f"checkpoint {r['checkpoint']['path']}" if "checkpoint" in r else f"preset {r['preset']}"
    stem = ",".join(map(str, r["stem_layers"])) or "none"
    ng = r.get("ngram")
    engram = ng["engram_layers"] if ng else []
    lines = [
        f"{source}: ffn {c['ffn']}, layers {stem} ({len(r['stem_layers'])} of {c['n_layers']})"
        + (f", engram layers {','.join(map(str, engram))}" if engram else "")
        + f", L={r['seq_len']}, {r['dtype_bytes']} bytes/value",
        f"d_model {c['d_model']}  n_layers {c['n_layers']}  heads {c['n_heads']} ({r['config']['n_kv_heads']} kv)  "
        f"d_ff {c['d_ff']}  vocab {c['vocab_size']}  tied {'yes' if c['tie_embeddings'] else 'no'}",
        *_ngram_lines(r),
        "",
        f"{'layer':>5}  {'kind':<12}{'attn proj':>11}{'attn QK,AV':>12}{'ffn':>11}{'total':>11}   forward FLOPs/token",
    ]
    for row in r["flops_per_layer"]:
        lines.append(f"{row['layer']:>5}  {row['kind']:<12}" + "".join(
            f"{human(row[k]):>{w}}" for k, w in (("attn_proj", 11), ("attn_scores", 12), ("ffn", 11), ("total", 11))))
    lines.append(f"{'head':>5}  {'lm_head':<12}{'':>34}{human(r['lm_head_flops_per_token']):>11}")
    vs = r["vs_dense"]
    lines += [
        "",
        f"{'':<38}{'this model':>12}{'/ dense':>10}",
        f"{'total parameters':<38}{human(r['total_params']):>12}{vs['total_params']:>9.3f}x",
        f"{'active parameters (embedding whole)':<38}{human(r['active_params']):>12}{vs['active_params']:>9.3f}x",
        f"{'active parameters (embedding row)':<38}{human(r['active_params_embedding_row']):>12}",
        f"{'forward FLOPs/token (full L)':<38}{human(r['flops_per_token_forward'], 'FLOP'):>12}{vs['flops_per_token_forward']:>9.3f}x",
        f"{'forward FLOPs/token (causal avg)':<38}{human(r['flops_per_token_forward_causal'], 'FLOP'):>12}",
        f"{'training FLOPs/token (3x fwd)':<38}{human(r['flops_per_token_train'], 'FLOP'):>12}",
        f"{'decode parameter bytes (batch 1)':<38}{human(r['decode_param_bytes'], 'B'):>12}{vs['decode_param_bytes']:>9.3f}x",
        f"{'KV cache bytes per sequence':<38}{human(r['kv_cache_bytes_per_sequence'], 'B'):>12}",
        *([f"{'table rows read per token':<38}{r['table_rows_per_token']:>12}",
           f"{'table bytes read per token':<38}{human(r['table_bytes_per_token'], 'B'):>12}"] if r["table_layers"] else []),
        *([f"{'row-sum adds/token (not in FLOPs)':<38}{human(r['table_sum_adds_per_token']):>12}"]
          if r["table_sum_adds_per_token"] else []),
        "",
        "parameters: " + ", ".join(f"{k} {human(v)}" for k, v in r["param_breakdown"].items()),
        f"saving per STEM layer, paper formula d_ff/(4d+2L+3d_ff): {_pct(r['saving_fraction_per_stem_layer'])}; "
        f"exact for {c['ffn']} with GQA: {_pct(r['layer_saving_fraction'])}; whole model: {_pct(r['model_flop_saving'])}",
    ]
    m = r["hash_moe_match"]
    lines.append(f"Hash-MoE match: {m['n_experts']} experts/layer = {human(m['hash_moe_layer_params'])} params vs "
                 f"{human(m['stem_layer_params'])} per STEM layer (ratio {m['ratio']:.3f})")
    if "checkpoint" in r:
        stored = r["checkpoint"]["stored_params"]
        lines.append(f"stored in the checkpoint: {human(stored)} parameters "
                     f"({'matches' if stored == r['total_params'] else 'DIFFERS from'} the count above)")
    return "\n".join(lines)
