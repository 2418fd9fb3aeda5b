"""Geometry of STEM tables (paper Fig. 4) and test-time capacity (paper §3.2).

geometry: pairwise cosine similarity of STEM rows, dense up-projection outputs W_u x and gated
          addresses SiLU(W_g x) * U[t] per layer on a real text sample -> geometry.json/.png
capacity: unique tokens and activated STEM parameters vs context length with a Heaps'-law fit
          U = K n^beta -> capacity.json/.png (a model with n-gram layers: also distinct n-gram keys,
          whose rows its n-gram layers activate)
ngram:    n-gram tables (ffn ngram/ngram_dagger/engram): slot occupancy and hash-collision rates per
          order against uniform hashing -> ngram.json/.png (stemlm/analyze/ngram.py)

Text comes from the validation split of --data (default: the default corpus if prepared),
else from the pinned Wikipedia passages tokenized with the checkpoint's tokenizer.

Examples:
  stemlm analyze geometry --ckpt runs/stem --dense-ckpt runs/dense --out runs/analysis
  stemlm analyze capacity --ckpt runs/stem --out runs/analysis --max-len 8192
  stemlm analyze ngram --ckpt runs/ngram --out runs/analysis --tokens 200000
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..runtime.files import atomic_write_text
from ..version import git_commit
from .options import add_checkpoint_argument, add_placement_arguments, non_negative_int, placement_from_args, positive_int


def add_arguments(parser) -> None:
    parser.add_argument("what", choices=("geometry", "capacity", "ngram"),
                        help="which analysis to run (ngram: slot occupancy and hash collisions of n-gram tables)")
    add_checkpoint_argument(parser)
    parser.add_argument("--data", default=None, help="prepared data dir for the text sample (default: the default corpus)")
    parser.add_argument("--out", default="runs/analysis", help="directory for the JSON and PNG outputs")
    parser.add_argument("--dense-ckpt", default=None, help="geometry: a dense model of the same depth to compare W_u x with")
    parser.add_argument("--seqs", type=positive_int, default=8, help="geometry: number of text windows")
    parser.add_argument("--seq-len", type=positive_int, default=None,
                        help="geometry: tokens per window, at most the model's max_seq_len (default: min(128, max_seq_len))")
    parser.add_argument("--max-points", type=positive_int, default=1500, help="geometry: vectors per kind and layer (subsampled)")
    parser.add_argument("--max-len", type=positive_int, default=8192, help="capacity: longest context length measured")
    parser.add_argument("--windows", type=positive_int, default=32, help="capacity: windows averaged per context length")
    parser.add_argument("--tokens", type=positive_int, default=200_000,
                        help="tokens of text to read at most (ngram: the whole sample is counted)")
    parser.add_argument("--seed", type=non_negative_int, default=0, help="seed of the window and point samples")
    add_placement_arguments(parser)


def _stream(args, ckpt_dir: Path):
    from ..analyze.text import token_stream
    from ..data import default_data_dir
    from ..data.codec import load_codec

    data = Path(args.data) if args.data else default_data_dir()
    tok = None
    if not (data / "val.bin").exists():
        tok = load_codec(ckpt_dir, data_dir=args.data, hint="pass --data DIR with a prepared corpus")
    return token_stream(data, tok, "val", args.tokens)


def run(args) -> int:
    from ..checkpoint.directory import read_config, resolve_checkpoint
    from ..store import open_model

    ckpt = resolve_checkpoint(args.ckpt)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stream, source = _stream(args, ckpt)
    if args.what == "capacity":
        from ..analyze.capacity import capacity, plot_capacity
        from ..analyze.ngram import ngram_key_function

        cfg = read_config(ckpt)
        keys = dict(keys=ngram_key_function(cfg, ckpt), n_key_layers=len(cfg.ngram_layers)) if cfg.ngram_layers else {}
        res = capacity(stream, len(cfg.table_layers), cfg.d_ff, cfg.d_model, args.max_len, args.windows, args.seed,
                       **keys)
        res["text"] = source
        fit = res["heaps"]
        print(f"Heaps fit on {source}: U = {fit['K']:.3f} n^{fit['beta']:.3f} (R² {fit['r2']:.4f})")
        if keys:
            kfit = res["heaps_keys"]
            print(f"distinct n-gram keys ({res['n_key_layers']} n-gram layer(s)): "
                  f"D = {kfit['K']:.3f} n^{kfit['beta']:.3f} (R² {kfit['r2']:.4f})")
        distinct = res.get("distinct_keys", [None] * len(res["context_length"]))
        for n, u, d, p in zip(res["context_length"], res["unique_tokens"], distinct, res["stem_params_activated"]):
            dk = "" if d is None else f"  keys={d:>9.1f}"
            print(f"  n={n:>6}  unique={u:>8.1f}{dk}  table params activated={p:>14,.0f}")
        print(f"  dense up-projections replaced: {res['dense_up_params']:,} parameters")
        png = plot_capacity(res, out / "capacity.png")
    elif args.what == "ngram":
        from ..analyze.ngram import ngram_key_function, ngram_stats, plot_ngram

        cfg = read_config(ckpt)
        res = ngram_stats(ngram_key_function(cfg, ckpt), stream)
        res["text"] = source
        print(f"n-gram layers {', '.join(map(str, res['ngram_layers']))}: {res['slots']:,} slots, "
              f"{res['keys_per_position']} keys per position, {res['positions']:,} positions of {source}")
        occ = "  ".join(f"{k} {v:.3f}" for k, v in res["occupancy_by_key"].items())
        print(f"  occupancy {res['occupancy']:.4f} ({res['slots_hit']:,} slots hit; by key: {occ})")
        for name, c in res["collisions"].items():
            print(f"  {name:<8} {c['ngrams']:>9,} n-grams  keys colliding {c['collision_rate']:.4f} "
                  f"(uniform hashing {c['expected_uniform']:.4f})  every head {c['all_heads_rate']:.4f}  "
                  f"heads sharing a slot {c['heads_shared_rate']:.4f}")
        png = plot_ngram(res, out / "ngram.png")
    else:
        from ..analyze.geometry import geometry, plot_geometry
        from ..analyze.text import windows

        model = open_model(ckpt, placement_from_args(args))
        dense = open_model(args.dense_ckpt) if args.dense_ckpt else None
        seq_len = model.cfg.check_seq_len(args.seq_len, "--seq-len") if args.seq_len else min(128, model.cfg.max_seq_len)
        ids = torch.from_numpy(windows(stream, seq_len, args.seqs, args.seed))  # (seqs, seq_len)
        res = geometry(model, ids, dense=dense, max_points=args.max_points, seed=args.seed)
        res["text"] = source
        for layer in res["layers"]:
            stats = "  ".join(f"{k}: mean|cos| {v['mean_abs']:.3f} p95|cos| {v['p95_abs']:.3f}"
                              for k, v in layer.items() if isinstance(v, dict))
            print(f"layer {layer['layer']} ({layer['kind']}): {stats}")
        png = plot_geometry(res, out / "geometry.png")
    res["git_commit"] = git_commit()  # the code that produced the numbers
    atomic_write_text(out / f"{args.what}.json", json.dumps(res, indent=2))
    print(f"wrote {out / (args.what + '.json')} and {png}")
    return 0
