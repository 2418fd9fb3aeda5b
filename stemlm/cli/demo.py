"""The facts demo: a small STEM model that knows the country facts, and one knowledge edit by rows.

Builds the facts-only corpus (seconds), trains a debug-sized STEM model on it with the editing
recipe of docs/editing.md (a few minutes on 2 CPU cores; a finished run is reused), prints how
many capitals it recalls on trained phrasings, held-out phrasings and never-trained countries,
then swaps the rows of two countries in every STEM layer and prints the paper's Fig. 5 panels:
the original model on "The capital of Spain is", the original model on "The capital of Germany
is", and the edited model on "The capital of Spain is". The edit is undone; the checkpoint is
never changed.

With --model smollm2 the same edit runs on a real pretrained model: SmolLM2-135M converted to STEM
with calibrated tables (stemlm convert --init calibrate; converted once, a few minutes), the capitals
it knows counted before the edit, then the two countries' rows swapped in its STEM layers.

examples:
  stemlm demo
  stemlm demo --model smollm2
  stemlm demo --model smollm2 --swap France=Italy --placement 1/3
  stemlm demo --swap France=Italy --out runs/demo
  stemlm demo --steps 300 --out runs/demo-short     # faster, knows fewer facts
"""

from __future__ import annotations

from .options import non_negative_int, positive_int


def add_arguments(parser) -> None:
    parser.add_argument("--out", default="runs/demo", help="run directory (default: runs/demo)")
    parser.add_argument("--steps", type=positive_int, default=1200, help="training steps (default: 1200)")
    parser.add_argument("--swap", default="Spain=Germany", metavar="A=B",
                        help="the two countries whose rows are swapped (default: Spain=Germany)")
    parser.add_argument("--seed", type=non_negative_int, default=0, help="training seed (default: 0)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.add_argument("--model", choices=["facts", "smollm2"], default="facts",
                        help="facts: train a small model on the country facts; smollm2: the real pretrained "
                        "SmolLM2-135M with calibrated STEM rows (default: facts)")
    parser.add_argument("--placement", default=None, metavar="SPEC",
                        help="with --model smollm2: the STEM layers ('full', '1/3', '0,2,5,...'; default: 0, the first "
                        "layer, whose rows carry the model's facts: docs/insertion.md)")
    parser.add_argument("--calib-tokens", type=positive_int, default=None,
                        help="with --model smollm2: calibration tokens of the conversion (default: 65536)")


def run(args) -> int:
    from ..demo import format_demo, run_demo
    from .edit import parse_pair

    if args.model == "smollm2":
        from ..demo_real import DEFAULT_CALIB_TOKENS, DEFAULT_PLACEMENT, format_real_demo, run_real_demo

        out = args.out if args.out != "runs/demo" else "runs/demo-smollm2"
        demo = run_real_demo(parse_pair(args.swap, "--swap"), args.placement or DEFAULT_PLACEMENT,
                             args.calib_tokens or DEFAULT_CALIB_TOKENS, out, progress=not args.no_progress)
        print(format_real_demo(demo))
        return 0
    if args.placement or args.calib_tokens:
        raise ValueError("--placement and --calib-tokens apply to --model smollm2 only")
    demo = run_demo(args.out, args.steps, parse_pair(args.swap, "--swap"), args.seed, progress=not args.no_progress)
    print(format_demo(demo))
    return 0
