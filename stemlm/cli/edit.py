"""Edit knowledge by rewriting STEM table rows and show the effect on next-token predictions.

Prints, for each prompt, the top-k next tokens of the original model, of the original model on
the target entity's prompt, and of the edited model (paper Fig. 5). The edit is undone before
exit; nothing is written to the checkpoint.

Examples:
  stemlm edit --ckpt runs/stem --swap Spain=Germany --prompt "The capital of Spain is"
  stemlm edit --ckpt runs/stem --copy "France=United States" --strategy average --prompt "The capital of France is"
  stemlm edit --ckpt runs/stem --forget Spain --prompt "The capital of Spain is" --plot forget.png
"""

from __future__ import annotations

import json
from pathlib import Path

from ..runtime.files import atomic_write_text
from ..edit.load import load_model_and_tokenizer
from ..edit.ops import forget, inject
from ..edit.report import edit_report, format_report, plot_report, swap_report
from ..edit.rows import resolve_layers
from ..edit.strategies import ALIGNS, STRATEGIES
from .options import add_checkpoint_argument, add_placement_arguments, positive_int, placement_from_args


def add_arguments(parser) -> None:
    add_checkpoint_argument(parser)
    parser.add_argument("--data", default=None, help="prepared data dir holding tokenizer.json (if the checkpoint has none)")
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--swap", metavar="A=B", help="exchange the rows of entities A and B")
    what.add_argument("--copy", metavar="A=B", help="give A the rows of B (B unchanged)")
    what.add_argument("--inject", metavar="NEW=KNOWN", help="give a new/rare name the rows of a known entity")
    what.add_argument("--forget", metavar="ENTITY", help="replace an entity's rows by a neutral row (--replacement)")
    parser.add_argument("--prompt", action="append", required=True, help="prompt to report (repeatable)")
    parser.add_argument("--layers", default="all", help="table layers to edit: 'all', a list like '2,5', or 'none'")
    parser.add_argument("--strategy", default="auto", choices=STRATEGIES, help="length-mismatch strategy (docs/editing.md)")
    parser.add_argument("--align", default="left", choices=ALIGNS, help="which ends of the two entities are aligned")
    parser.add_argument("--filler", default=None, help="filler token for --strategy filler (default: end-of-text)")
    parser.add_argument("--replacement", default="mean", help="--forget: 'mean', 'zero', or an entity whose rows to use")
    parser.add_argument("--embedding", action="store_true",
                        help="also edit the input-embedding rows (diagnostic: not a STEM edit; with --layers none, only them)")
    parser.add_argument("--no-leading-space", action="store_true", help="tokenize entities without a leading space")
    parser.add_argument("--top-k", type=positive_int, default=5, help="next tokens to show per panel")
    parser.add_argument("--plot", default=None, help="write a PNG bar chart here (one file per prompt, suffixed if several)")
    parser.add_argument("--json", default=None, help="write the reports as JSON here")
    add_placement_arguments(parser)


def parse_pair(text: str, flag: str) -> tuple[str, str]:
    """``"Spain=Germany"`` -> ``("Spain", "Germany")``."""
    if text.count("=") != 1 or not all(p.strip() for p in text.split("=")):
        raise ValueError(f"{flag} expects A=B, got {text!r}")
    a, b = text.split("=")
    return a.strip(), b.strip()


def parse_layers(text: str) -> list[int] | None:
    """``"all"`` -> None, ``"2,5"`` -> [2, 5], ``"none"`` -> [] (with --embedding: the embedding alone)."""
    if text.strip().lower() == "all":
        return None
    if text.strip().lower() == "none":
        return []
    try:
        return [int(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise ValueError(f"--layers expects 'all' or a list like '2,5', got {text!r}") from None


def _report(args, model, tok, prompt: str):
    common = dict(layers=parse_layers(args.layers), leading_space=not args.no_leading_space)
    if args.forget:
        repl = args.replacement
        return edit_report(model, tok, prompt, lambda: forget(model, args.forget, replacement=repl, tokenizer=tok, **common),
                           k=args.top_k, source=args.forget)
    flag, pair = (("--swap", args.swap) if args.swap else ("--copy", args.copy) if args.copy else ("--inject", args.inject))
    a, b = parse_pair(pair, flag)
    kwargs = dict(strategy=args.strategy, align=args.align, filler=args.filler, embedding=args.embedding, **common)
    if args.inject:
        return edit_report(model, tok, prompt, lambda: inject(model, a, b, tokenizer=tok, **kwargs), k=args.top_k, source=a)
    return swap_report(model, tok, prompt, a, b, k=args.top_k, mode="swap" if args.swap else "copy", **kwargs)


def run(args) -> int:
    model, tok = load_model_and_tokenizer(args.ckpt, args.data, placement_from_args(args))
    layers = parse_layers(args.layers)
    if not (layers == [] and args.embedding):
        resolve_layers(model, layers)  # a bad --layers fails before any work
    reports = []
    for i, prompt in enumerate(args.prompt):
        report = _report(args, model, tok, prompt)
        reports.append(report.to_dict())
        print(format_report(report) + "\n")
        if args.plot:
            path = Path(args.plot)
            if len(args.prompt) > 1:
                path = path.with_name(f"{path.stem}_{i}{path.suffix}")
            print(f"wrote {plot_report(report, path)}")
    if args.json:
        atomic_write_text(Path(args.json), json.dumps(reports, indent=2))
        print(f"wrote {args.json}")
    return 0
