"""Evaluate knowledge edits over country facts: success rate, probability shift, locality, undo.

Pairs of countries are edited (swap by default) and every fact prompt of the edited country is
checked against the other country's answer; only facts the unedited model already knows count
(the denominator is reported). See docs/editing.md for the metric definitions.

Examples:
  stemlm edit-eval --ckpt runs/stem --out benchmarks/results/edit_eval.json
  stemlm edit-eval --ckpt runs/stem --split train --strategies auto,filler,clone,average --layers-sweep
"""

from __future__ import annotations

import json
from pathlib import Path

from ..runtime.files import atomic_write_text
from ..edit.evaluate import EditEvalConfig, layer_sweep, run_edit_eval
from ..edit.load import load_model_and_tokenizer
from ..edit.ops import MODES
from ..edit.strategies import ALIGNS
from .edit import parse_layers
from .options import add_checkpoint_argument, add_placement_arguments, non_negative_int, positive_int, placement_from_args


def add_arguments(parser) -> None:
    add_checkpoint_argument(parser)
    parser.add_argument("--data", default=None, help="prepared data dir with facts/facts.jsonl (default: the default corpus)")
    parser.add_argument("--split", default="heldout_template", choices=("train", "heldout_template", "heldout_country"),
                        help="which facts to probe (heldout_template: phrasings never trained on)")
    parser.add_argument("--strategies", default="auto", help="comma list of strategies: auto,one_to_one,filler,clone,average")
    parser.add_argument("--align", default="left", choices=ALIGNS, help="alignment for filler/clone")
    parser.add_argument("--mode", default="swap", choices=MODES, help="swap both ways, or copy B's rows into A only")
    parser.add_argument("--layers", default="all", help="table layers to edit: 'all' or a list like '2,5'")
    parser.add_argument("--layers-sweep", action="store_true", help="also edit the first k and last k table layers, k=1..|S|")
    parser.add_argument("--pairs", type=positive_int, default=50, help="number of country pairs")
    parser.add_argument("--locality", type=non_negative_int, default=64, help="unrelated fact prompts per edit")
    parser.add_argument("--relations", default=None, help="comma list of relations (default: all)")
    parser.add_argument("--filler", default=None, help="filler token for the filler strategy (default: end-of-text)")
    parser.add_argument("--embedding", action="store_true",
                        help="also swap the input-embedding rows (diagnostic upper bound, not a STEM edit)")
    parser.add_argument("--seed", type=non_negative_int, default=0, help="seed of the pair and locality samples")
    parser.add_argument("--out", default=None, help="write the results JSON here")
    add_placement_arguments(parser)


def run(args) -> int:
    from ..data import default_data_dir, load_facts

    data_dir = Path(args.data) if args.data else default_data_dir()
    facts = load_facts(data_dir)
    model, tok = load_model_and_tokenizer(args.ckpt, data_dir, placement_from_args(args))
    layers = parse_layers(args.layers)
    sets = layer_sweep(model) if args.layers_sweep else {args.layers: layers}
    cfg = EditEvalConfig(split=args.split, strategies=tuple(s.strip() for s in args.strategies.split(",") if s.strip()),
                         align=args.align, mode=args.mode, n_pairs=args.pairs, n_locality=args.locality, seed=args.seed,
                         filler=args.filler, layer_sets=sets, embedding=args.embedding,
                         relations=tuple(args.relations.split(",")) if args.relations else None)
    result = run_edit_eval(model, tok, facts, cfg)
    result["ckpt"], result["data"] = str(args.ckpt), str(data_dir)
    print(format_runs(result))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(Path(args.out), json.dumps(result, indent=2))
        print(f"wrote {args.out}")
    return 0


def _pct(x) -> str:
    return "  -  " if x is None else f"{100 * x:5.1f}"


def format_runs(result: dict) -> str:
    """One line per (strategy, layer set)."""
    b = result["base"]
    lines = [f"probes {b['probes']} of {b['countries']} countries, known (first token) {b['known_first']}, "
             f"multi-token country names {b['multi_token_countries']}",
             f"{'strategy':<11} {'layers':<10} {'known':>6} {'succ%':>6} {'full%':>6} {'dP':>6} {'loc%':>6} {'KL':>8} {'undo%':>6}"]
    for r in result["runs"]:
        shift = "  -  " if r["prob_shift"] is None else f"{r['prob_shift']:+.3f}"
        kl = "   -   " if r["locality_kl"] is None else f"{r['locality_kl']:.2e}"
        lines.append(f"{r['strategy']:<11} {r['layers_label']:<10} {r['known']:>6} {_pct(r['success']):>6} "
                     f"{_pct(r['success_full']):>6} {shift:>6} {_pct(r['locality_top1']):>6} {kl:>8} {_pct(r['reversible']):>6}")
    return "\n".join(lines)
