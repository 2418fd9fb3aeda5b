"""Prepare the default offline corpus (Wikipedia passages + country facts) or your own text, and
show what a prepared data dir holds.

examples:
  stemlm data prepare                          # default corpus into $STEMLM_CACHE/data/default-v1
  stemlm data prepare --corpus wide            # the wide corpus (~10x the text) into $STEMLM_CACHE/data/wide-v1
  stemlm data prepare --vocab-size 8192 --out runs/data8k
  stemlm data prepare --data notes/ more.jsonl --out runs/mydata
  stemlm data info
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from .options import non_negative_int, open_fraction, positive_int


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True, metavar="{prepare,info}")
    prep = sub.add_parser("prepare", help="build a data dir (tokenizer, token files, facts)",
                          description="Build a data dir: tokenizer.json, train/val token files, meta.json, facts.")
    prep.add_argument("--corpus", choices=("default", "wide"), default="default",
                      help="which offline corpus: default (BoolQ's Wikipedia passages + country facts, 2.4M tokens) or "
                           "wide (also QuAC, NarrativeQA, Python and Linux docs, GCIDE, State of the Union; see "
                           "docs/data.md); default: default")
    prep.add_argument("--out", type=Path, default=None,
                      help="output dir (default: $STEMLM_CACHE/data/default-v1, or wide-v1 with --corpus wide)")
    prep.add_argument("--vocab-size", type=positive_int, default=4096, help="BPE vocabulary size to train (default 4096)")
    prep.add_argument("--data", type=Path, nargs="+", default=None, metavar="PATH",
                      help="your own text instead of the default corpus: .txt/.md files, directories, .jsonl ('text')")
    prep.add_argument("--tokenizer", type=Path, default=None,
                      help="use this tokenizer.json (or a dir holding it) instead of training one")
    prep.add_argument("--force", action="store_true", help="rebuild even if the dir is complete")
    prep.add_argument("--fact-repeats", type=positive_int, default=4,
                      help="times each training fact sentence appears in the default corpus (default 4)")
    prep.add_argument("--no-entity-tokens", action="store_true",
                      help="do not force country names and capitals to be single tokens")
    prep.add_argument("--val-fraction", type=open_fraction, default=0.02, help="fraction of prose documents held out")
    prep.add_argument("--seed", type=non_negative_int, default=0, help="seed of the splits and the document shuffle")
    prep.add_argument("--quiet", action="store_true", help="no progress bars")
    info = sub.add_parser("info", help="summarize a prepared data dir", description="Summarize a prepared data dir.")
    info.add_argument("--dir", type=Path, default=None, help="data dir (default: the default corpus dir)")
    info.add_argument("--json", action="store_true", help="print the summary as JSON")


def run(args: argparse.Namespace) -> int:
    from stemlm.data import corpus

    if args.action == "prepare":
        if args.data and args.corpus != "default":
            raise ValueError("--data builds a corpus from your files; it does not combine with --corpus")
        if args.corpus == "wide":
            from stemlm.data.wide import prepare_wide_corpus

            out = prepare_wide_corpus(args.out, vocab_size=args.vocab_size, force=args.force, progress=not args.quiet,
                                      fact_repeats=args.fact_repeats, val_fraction=args.val_fraction, seed=args.seed,
                                      tokenizer=args.tokenizer, entity_tokens=not args.no_entity_tokens)
        elif args.data:
            if args.out is None:
                raise ValueError("--data needs --out DIR (the default dir is reserved for the default corpus)")
            out = corpus.prepare_corpus(args.data, args.out, vocab_size=args.vocab_size, tokenizer=args.tokenizer,
                                        val_fraction=args.val_fraction, seed=args.seed, force=args.force,
                                        progress=not args.quiet)
        else:
            out = corpus.prepare_default_corpus(
                args.out, vocab_size=args.vocab_size, force=args.force, progress=not args.quiet,
                fact_repeats=args.fact_repeats, entity_tokens=not args.no_entity_tokens, tokenizer=args.tokenizer,
                val_fraction=args.val_fraction, seed=args.seed)
        print(out)
        return 0
    info = corpus.data_info(args.dir or corpus.default_data_dir())
    print(json.dumps(info, indent=2) if args.json else _format(info))
    return 0


def _format(info: dict) -> str:
    lines = [f"data dir     {info['dir']}{'' if info['complete'] else '  (INCOMPLETE)'}",
             f"vocab        {info.get('vocab_size')} (eos id {info.get('eos_id')}, {info.get('dtype')})"]
    for split, n in info.get("n_tokens", {}).items():
        lines.append(f"{split:<12} {n:,} tokens, {info.get('n_docs', {}).get(split, 0):,} documents")
    if "n_countries" in info:
        lines.append(f"single-token countries {info['single_token_countries']}/{info['n_countries']}, "
                     f"capitals {info.get('single_token_capitals')}/{info.get('n_capitals')}")
    if "facts" in info:
        lines.append("facts        " + ", ".join(f"{k} {v}" for k, v in sorted(info["facts"].items())))
    lines += [f"note         {n}" for n in info.get("notes", [])]
    lines.append("files        " + ", ".join(f"{k} {v / 1e6:.2f} MB" for k, v in info["bytes"].items() if v > 1e5))
    return "\n".join(lines)
