"""The facts demo: a small STEM model that knows the country facts, and one knowledge edit by rows.

Builds the facts-only corpus (seconds), trains a debug-sized STEM model on it with the editing
recipe of docs/editing.md (a few minutes on 2 CPU cores; a finished run is reused), prints how
many capitals it recalls on trained phrasings, held-out phrasings and never-trained countries,
then swaps the rows of two countries in every STEM layer and prints the paper's Fig. 5 panels:
the original model on "The capital of Spain is", the original model on "The capital of Germany
is", and the edited model on "The capital of Spain is". The edit is undone; the checkpoint is
never changed.

examples:
  stemlm demo
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


def run(args) -> int:
    from ..demo import format_demo, run_demo
    from .edit import parse_pair

    demo = run_demo(args.out, args.steps, parse_pair(args.swap, "--swap"), args.seed, progress=not args.no_progress)
    print(format_demo(demo))
    return 0
