"""Validation loss and perplexity of a checkpoint (or of a training run's newest checkpoint).

The data dir, batch size and sequence length default to the run's config.yaml beside the
checkpoint; evaluation reads consecutive windows from the start of the validation split, so the
numbers of different checkpoints are comparable.

examples:
  stemlm eval-ppl --ckpt runs/default
  stemlm eval-ppl --ckpt runs/default/checkpoints/step_00000400 --batches 100 --json
  stemlm eval-ppl --ckpt runs/default --data my_data --seq-len 256
"""

from __future__ import annotations

import argparse
import json

from .options import (add_checkpoint_argument, add_matmul_argument, add_placement_arguments, add_verify_argument,
                      placement_from_args, positive_int)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_checkpoint_argument(parser)
    parser.add_argument("--data", default=None, help="prepared data dir (default: the run's data.dir, else the default corpus)")
    parser.add_argument("--batches", type=positive_int, default=None,
                        help="validation batches to average over; more than the split holds is an error "
                             "(default: 50, or all of them if the split holds fewer)")
    parser.add_argument("--batch-size", type=positive_int, default=None, help="sequences per batch (default: the run's data.batch_size)")
    parser.add_argument("--seq-len", type=positive_int, default=None, help="tokens per sequence (default: the run's data.seq_len)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="compute dtype (default: float32)")
    add_matmul_argument(parser)
    add_placement_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar (it goes to stderr)")
    add_verify_argument(parser)


def run(args) -> int:
    from ..train.evaluate import evaluate_checkpoint

    out = evaluate_checkpoint(args.ckpt, args.data, args.batches, args.batch_size, args.seq_len, placement_from_args(args),
                              args.dtype, args.matmul, progress=not args.no_progress, verify=args.verify)
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(f"checkpoint {out['checkpoint']}\ndata       {out['data']}\n"
              f"val loss   {out['loss']:.4f} nats/token over {out['tokens']} tokens "
              f"({out['batches']} of {out['batches_available']} batches of {out['batch_size']} x {out['seq_len']})\n"
              f"perplexity {out['ppl']:.2f}")
    return 0
