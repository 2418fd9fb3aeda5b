"""Accuracy of one or more models on benchmark tasks, from pinned offline data.

Tasks (comma-separated; groups: core = the ten multiple-choice tasks, bpb, qa):
  arc_easy arc_challenge boolq piqa socialiqa hellaswag openbookqa winogrande csqa sciq
  mmlu (and mmlu_<subject>), <name>_bpb (lambada, gsm8k, squad, drop, coqa, jeopardy, naturalqs_open,
  minerva_math_*), trivia_qa, nq_open, country_facts, needle. See docs/evaluation.md.

Results per request are cached per model (--cache-dir), so an interrupted run continues where it
stopped. --output writes the JSON results (one model: its document; several: {"models": [...]}),
a bar chart PNG beside it when several models are compared, and the needle heatmap PNG.

examples:
  stemlm eval --ckpt runs/default --tasks core --limit 200 --output results/default.json
  stemlm eval --ckpt smollm2 --tasks arc_easy,mmlu --shots 5 --limit 50
  stemlm eval --ckpt runs/stem --ckpt runs/dense --tasks core,country_facts --output cmp.json
  stemlm eval --ckpt runs/stem --tables disk --cache-rows 4096 --tasks core  (--model is an alias of --ckpt)
"""

from __future__ import annotations

import argparse
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ..runtime.artifacts import cache_dir
    from ..eval.models import ENGINES
    from .options import add_checkpoint_argument, add_matmul_argument, add_placement_arguments

    add_checkpoint_argument(parser, multiple=True,
                            help="stemlm run/checkpoint dir, Llama dir, .gguf file or 'smollm2'; repeat to compare")
    parser.add_argument("--gguf", default=None, help="GGUF file name inside --ckpt's directory (default: none)")
    add_placement_arguments(parser)
    parser.add_argument("--tasks", required=True, help="comma-separated task or group names (e.g. core,mmlu)")
    parser.add_argument("--shots", type=int, default=0, choices=(0, 5), help="few-shot examples (default: 0)")
    parser.add_argument("--limit", type=int, default=None,
                        help="seeded subsample of N items per task, the same for every model (default: all)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the --limit subsample (default: 0)")
    parser.add_argument("--output", type=Path, default=None, help="results JSON file (default: none, table only)")
    parser.add_argument("--batch-size", type=int, default=32, help="requests per model call (default: 32)")
    add_matmul_argument(parser, default="aten")
    parser.add_argument("--engine", default=None, choices=ENGINES, help="evaluation engine (default: the loader's)")
    parser.add_argument("--cache-dir", type=Path, default=cache_dir() / "eval",
                        help="per-request result cache (default: %(default)s)")
    parser.add_argument("--no-cache", action="store_true", help="neither read nor write the result cache")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")


def run(args) -> int:
    from ..eval.run import evaluate_paths, format_paired, format_table, paired
    from .options import placement_from_args

    placement = placement_from_args(args)
    docs, written = evaluate_paths(args.ckpt, args.tasks, args.shots, args.limit, args.seed, args.output,
                                   None if args.no_cache else args.cache_dir, args.batch_size, not args.no_progress,
                                   gguf=args.gguf, placement=placement, device=placement.device, engine=args.engine,
                                   matmul=args.matmul)
    print(format_table(docs))
    print(f"above: value - 2 stderr > chance; stemlm {docs[0]['stemlm']}")
    if pairs := format_paired(paired(docs)):
        print(f"\npaired on the same items, each model against the first:\n{pairs}")
    for path in written:
        print(f"wrote {path}")
    return 0
