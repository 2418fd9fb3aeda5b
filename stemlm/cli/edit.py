"""Edit knowledge by rewriting STEM table rows and show the effect on next-token predictions.

Prints, for each prompt, the top-k next tokens of the original model, of the original model on
the target entity's prompt, and of the edited model (paper Fig. 5). The edit is undone before
exit; nothing is written to the checkpoint.

Examples:
  stemlm edit --ckpt runs/stem --swap Spain=Germany --prompt "The capital of Spain is"
  stemlm edit --ckpt runs/stem --copy "France=United States" --strategy average --prompt "The capital of France is"
  stemlm edit --ckpt runs/stem --forget Spain --prompt "The capital of Spain is" --plot forget.png
  stemlm edit --ckpt runs/ngram --ngram-copy "of Spain=of Germany" --prompt "The capital of Spain is"

n-gram edits (--ngram-copy/--ngram-swap, models with n-gram layers) rewrite the hashed rows of one
n-gram (its last position's bigram/trigram keys), not the token rows: see docs/editing.md.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..runtime.files import atomic_write_text
from ..edit.load import load_model_and_tokenizer
from ..edit.ops import forget, inject
from ..edit.report import edit_report, format_report, ngram_report, plot_report, swap_report
from ..edit.rows import resolve_layers
from ..edit.strategies import ALIGNS, STRATEGIES
from .options import add_checkpoint_argument, add_placement_arguments, non_negative_int, positive_int, placement_from_args


def add_arguments(parser) -> None:
    add_checkpoint_argument(parser)
    parser.add_argument("--data", default=None, help="prepared data dir holding tokenizer.json (if the checkpoint has none)")
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--swap", metavar="A=B", help="exchange the rows of entities A and B")
    what.add_argument("--copy", metavar="A=B", help="give A the rows of B (B unchanged)")
    what.add_argument("--inject", metavar="NEW=KNOWN", help="give a new/rare name the rows of a known entity")
    what.add_argument("--forget", metavar="ENTITY", help="replace an entity's rows by a neutral row (--replacement)")
    what.add_argument("--ngram-copy", metavar="A=B",
                      help="n-gram layers: give the n-gram A (2+ tokens, e.g. 'of Spain') the hashed rows of the n-gram B "
                           "('of Germany') in every n-gram layer; the token row (key 0) is not written")
    what.add_argument("--ngram-swap", metavar="A=B",
                      help="n-gram layers: exchange the hashed rows of the n-grams A and B (refused if they share a slot)")
    parser.add_argument("--prompt", action="append", required=True, help="prompt to report (repeatable)")
    parser.add_argument("--layers", default="all", help="table layers to edit: 'all', a list like '2,5', or 'none' "
                        "(--ngram-copy/--ngram-swap: n-gram layers only; 'all' = every n-gram layer)")
    parser.add_argument("--strategy", default="auto", choices=STRATEGIES, help="length-mismatch strategy (docs/editing.md)")
    parser.add_argument("--align", default="left", choices=ALIGNS, help="which ends of the two entities are aligned")
    parser.add_argument("--filler", default=None, help="filler token for --strategy filler (default: end-of-text)")
    parser.add_argument("--replacement", default="mean", help="--forget: 'mean', 'zero', or an entity whose rows to use")
    parser.add_argument("--embedding", action="store_true",
                        help="also edit the input-embedding rows (diagnostic: not a STEM edit; with --layers none, only them)")
    parser.add_argument("--no-leading-space", action="store_true", help="tokenize entities without a leading space")
    parser.add_argument("--ngram-orders", default=None, metavar="N,...",
                        help="--ngram-copy/--ngram-swap: the hash orders to edit, e.g. '2' "
                             "(default: every model order up to the n-gram's length)")
    parser.add_argument("--sample-tokens", type=non_negative_int, default=100_000,
                        help="--ngram-copy/--ngram-swap: tokens of the validation split of --data (or of the default "
                             "corpus) in which to count the other n-grams that share the edited slots; 0 skips the count")
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


def parse_orders(text: str | None) -> list[int] | None:
    """``None`` -> None (every order that fits), ``"2,3"`` -> [2, 3]."""
    if text is None:
        return None
    try:
        orders = [int(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise ValueError(f"--ngram-orders expects a list like '2,3', got {text!r}") from None
    if not orders:
        raise ValueError("--ngram-orders is empty")
    return orders


def _ngram_pair(args) -> tuple[str, str, str] | None:
    """``(source, target, mode)`` of an n-gram edit, or None for a token edit."""
    if args.ngram_copy:
        return (*parse_pair(args.ngram_copy, "--ngram-copy"), "copy")
    if args.ngram_swap:
        return (*parse_pair(args.ngram_swap, "--ngram-swap"), "swap")
    return None


def _ngram_sharers(args, model, tok) -> dict:
    """Plan the n-gram edit (every input checked) and count who else in a corpus sample reads its slots."""
    from ..analyze.ngram import slot_sharers
    from ..analyze.text import stream_from_data
    from ..data import default_data_dir
    from ..edit.ngram import canonical_suffixes, plan_ngram_edit
    from ..edit.tokens import entity_ids

    a, b, mode = _ngram_pair(args)
    if args.embedding:
        raise ValueError("--embedding applies to token edits, not to --ngram-copy/--ngram-swap")
    vocab, space = model.cfg.vocab_size, not args.no_leading_space
    src, tgt = entity_ids(tok, a, vocab, space), entity_ids(tok, b, vocab, space)
    plan = plan_ngram_edit(model, src, tgt, layers=parse_layers(args.layers), mode=mode, orders=parse_orders(args.ngram_orders),
                           tokenizer=tok)
    data = Path(args.data) if args.data else default_data_dir()
    if args.sample_tokens == 0:
        return {"skipped": "--sample-tokens 0"}
    if not (data / "val.bin").exists():
        return {"skipped": f"no prepared validation split in {data} (pass --data DIR)"}
    stream = stream_from_data(data, "val", args.sample_tokens)
    exclude = canonical_suffixes(model, src, plan.orders)
    if mode == "swap":
        exclude += canonical_suffixes(model, tgt, plan.orders)
    out = slot_sharers(model.ngram_keys, stream, plan.slots, exclude)
    out["text"] = f"{data}:val"
    return out


def _report(args, model, tok, prompt: str):
    common = dict(layers=parse_layers(args.layers), leading_space=not args.no_leading_space)
    if (ngram := _ngram_pair(args)) is not None:
        a, b, mode = ngram
        return ngram_report(model, tok, prompt, a, b, k=args.top_k, mode=mode, orders=parse_orders(args.ngram_orders),
                            **common)
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
    sharers = None
    if _ngram_pair(args) is not None:
        sharers = _ngram_sharers(args, model, tok)
        if "skipped" in sharers:
            print(f"n-gram collisions not counted: {sharers['skipped']}")
        else:
            by_order = ", ".join(f"{k} {v}" for k, v in sharers["by_order"].items())
            print(f"edited slots in {sharers['text']} ({sharers['sample_positions']:,} tokens): read at "
                  f"{sharers['positions']:,} positions (the edited n-gram's own included), by {sharers['ngrams']:,} other "
                  f"n-gram(s) ({by_order}); token rows of {len(sharers['sample_tokens'])} of its tokens")
    reports = []
    for i, prompt in enumerate(args.prompt):
        report = _report(args, model, tok, prompt)
        if sharers is not None:
            report.details["sharers"] = sharers
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
