"""Knowledge edits on a real pretrained model: SmolLM2-135M with calibrated STEM rows.

What no other system offers: swap the table rows of two countries in a real model and check
that "The capital of Spain is" answers Berlin, on facts the model actually knows.

1. **Convert** SmolLM2-135M once into ``stem_dagger`` in every layer but the first, its tables the
   *calibrated* STEM rows fitted on the dense model's own activations (``--calib-parallel``), so
   that ``stemlm.edit.attribution.stem_at`` can place pure STEM at any set of layers of the dense
   model without reloading anything.
2. **Placements**: the dense model's known facts; then STEM at the paper's 1/3 placement, at every
   layer, and at each single layer (per-layer attribution), each edited by swapping country rows in
   the placed layers. Per placement and phrasing split (``train``: the facts corpus's training
   template; ``heldout_template``: phrasings the mid-training never shows): swap success on known
   facts, probability shift, locality (other countries' answers unchanged) and exact undo. Single
   layers are attributed on the held-out phrasings only.
3. **Mid-trained** (optional, ``--ckpt``): the same evaluation on mid-trained STEM checkpoints
   (e.g. the STEM-1/3 arms of ``stemlm study run --spec midtrain``).

    python benchmarks/bench_edit_real.py                       # -> benchmarks/results/edit_real.json
    python benchmarks/bench_edit_real.py --ckpt RUN [--ckpt RUN2]
    python benchmarks/bench_edit_real.py --quick               # a smoke run on few pairs and layers
    python benchmarks/bench_edit_real.py --table-layers 0+1/3 --layers none --placement layer0=0 \
        --tag layer0                                           # STEM at layer 0 (see bench_edit_trace.py)
    python benchmarks/bench_edit_real.py --table-layers 0 --singles-only --layers none --placement layer0=0 \
        --calib-unseen regress --calib-tokens 262144 --tag layer0-regress   # layer 0 alone, unseen ids regressed

The conversion lives under ``runs/edit_real/`` (not in git); results carry the git commit.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from _train_bench import bench_work

from stemlm.runtime.files import atomic_write_text
from stemlm.edit.strategies import ALIGNS, STRATEGIES
from stemlm.version import git_commit

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(os.environ.get("STEMLM_BENCH_RESULTS") or ROOT / "benchmarks" / "results")
RUN_DIR = bench_work(ROOT / "runs" / "edit_real")
SPLITS = ("heldout_template", "train")


def table_layers(spec: str, n_layers: int) -> list[int]:
    """Layers of a ``+``-joined placement spec: ``full`` (1..n-1), ``0+1/3`` (layer 0 and the 1/3 placement), ..."""
    from stemlm.config import resolve_stem_layers

    return sorted({i for part in spec.split("+") for i in resolve_stem_layers(part, n_layers)})


def convert(calib_tokens: int, out: Path, layers: list[int] | str = "full", unseen: str = "pooled") -> Path:
    """SmolLM2-135M as stem_dagger in ``layers`` (default 1..29) with calibrated (parallel-fitted) rows (once);
    ``unseen``: the rows of ids the calibration text never shows (``CalibrationConfig.unseen``)."""
    from stemlm.insert.calibrate import CalibrationConfig
    from stemlm.interop.convert import convert_from_hf

    if (out / "config.json").exists():
        return out
    calib = CalibrationConfig(tokens=calib_tokens, sequential=False, dagger_rows="fit", unseen=unseen,
                              shrink=0.0)  # the rows the recorded edits were measured with, whatever convert's default
    return convert_from_hf("smollm2", out, ffn="stem_dagger", stem_layers=layers, init="calibrate", calibration=calib,
                           log=print)


def open_for_edits(ckpt: Path):
    """``(model, facts, codec)``: the model with its tables mapped from disk copy-on-write (29 tables of
    SmolLM2 are 8.8 GB: only the rows the prompts use are read, and edits never reach the file)."""
    from stemlm.data import corpus_in_vocabulary, load_facts
    from stemlm.edit.load import load_model_and_tokenizer

    corpus = corpus_in_vocabulary(ckpt / "tokenizer.json")
    model, tok = load_model_and_tokenizer(ckpt, corpus, "disk")
    return model, load_facts(corpus), tok


def summarise(result: dict) -> dict:
    """The numbers of one ``run_edit_eval`` result worth keeping per placement."""
    run = result["runs"][0]
    keys = ("known", "success", "prob_target_before", "prob_target_after", "prob_shift", "locality_top1",
            "locality_kl", "locality_known", "locality_known_n", "locality_shared", "locality_shared_n",
            "locality_disjoint", "locality_disjoint_n", "reversible", "pairs", "by_length")
    return {"layers": run["layers"], "known_facts": result["base"]["known_first"], "probes": result["base"]["probes"],
            **{k: run[k] for k in keys}}


def dense_known(model, tok, facts) -> dict:
    """Per split: capital facts the dense model answers right (first token; whole answer) of those asked."""
    from stemlm.edit.attribution import stem_at
    from stemlm.edit.probes import build_probes
    from stemlm.edit.scoring import score

    out = {}
    with stem_at(model, []), torch.no_grad():
        for split in SPLITS:
            probes = [q for ps in build_probes(facts, tok, split, ("capital",)).values() for q in ps]
            s = score(model, [q.prompt_ids for q in probes], [q.answer_ids for q in probes])
            out[split] = {"first": int(s.first_ok.sum()), "full": int(s.full_ok.sum()), "asked": len(probes)}
            print(f"dense {split}: {out[split]}")
    return out


def evaluate_placements(model, tok, facts, placements: dict[str, list[int]], args) -> dict:
    from stemlm.edit.attribution import placement_edits
    from stemlm.edit.evaluate import EditEvalConfig

    out = {}
    for split in SPLITS:
        cfg = EditEvalConfig(split=split, n_pairs=args.pairs, n_locality=args.locality, relations=("capital",),
                             seed=0, strategies=(args.strategy,), align=args.align, protect_shared=args.protect_shared)
        t0 = time.perf_counter()
        chosen = {k: v for k, v in placements.items() if split == SPLITS[0] or not k.isdigit()}  # single layers: held-out only
        res = placement_edits(model, tok, facts, cfg, chosen, progress=True)
        out[split] = {label: summarise(r) for label, r in res.items()}
        print(f"{split}: {len(chosen)} placements in {time.perf_counter() - t0:.0f}s")
        for label, r in out[split].items():
            print(f"  {label:>6}: known {r['known']:4d}  success {fmt(r['success'])}  locality {fmt(r['locality_top1'])}"
                  f" (known facts {fmt(r['locality_known'])})"
                  f"  undo {fmt(r['reversible'])}")
    return out


def evaluate_checkpoint(path: str, args) -> dict:
    from stemlm.edit.evaluate import EditEvalConfig, run_edit_eval
    from stemlm.checkpoint.directory import resolve_checkpoint

    ckpt = resolve_checkpoint(path)
    model, facts, tok = open_for_edits(ckpt if (ckpt / "tokenizer.json").exists() else Path(path))
    out = {}
    for split in SPLITS:
        cfg = EditEvalConfig(split=split, n_pairs=args.pairs, n_locality=args.locality, relations=("capital",))
        out[split] = summarise(run_edit_eval(model, tok, facts, cfg))
    return {"checkpoint": str(ckpt), "layers": list(model.cfg.table_layers), **out}


def fmt(x) -> str:
    return "  -  " if x is None else f"{x:.3f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="4 pairs, 3 single layers, 16k calibration tokens")
    p.add_argument("--calib-tokens", type=int, default=131072, help="calibration tokens (default: %(default)s)")
    p.add_argument("--pairs", type=int, default=40, help="country pairs per placement (default: %(default)s)")
    p.add_argument("--locality", type=int, default=32, help="unrelated prompts per edit (default: %(default)s)")
    p.add_argument("--layers", default="all", help="single layers to attribute: 'all', 'none' or '2,5,...'")
    p.add_argument("--placement", action="append", default=[], metavar="LABEL=LAYERS",
                   help="another placement to evaluate, e.g. 'early=1,2,3,4,5,6' (repeatable)")
    p.add_argument("--singles-only", action="store_true", help="only the single layers of --layers (no 1/3 and full)")
    p.add_argument("--ckpt", action="append", default=[], help="also evaluate this mid-trained STEM checkpoint")
    p.add_argument("--table-layers", default="full",
                   help="layers converted (placements choose among them): 'full' (1..29, default), or '+'-joined "
                        "specs such as '0+1/3' (layer 0, which the paper's placements never convert, and 1/3)")
    p.add_argument("--calib-unseen", default="pooled", choices=("pooled", "regress", "zero"),
                   help="rows of ids the calibration never shows (default: %(default)s; regress: from the embedding)")
    p.add_argument("--strategy", default="auto", choices=STRATEGIES,
                   help="how names of different token lengths take each other's rows (stemlm.edit.strategies; "
                        "default: %(default)s)")
    p.add_argument("--align", default="left", choices=ALIGNS, help="token alignment of --strategy (default: %(default)s)")
    p.add_argument("--protect-shared", action="store_true",
                   help="leave the rows of subwords two or more country names hold (no other country's prompt changes)")
    p.add_argument("--ckpt-only", action="store_true", help="evaluate only the --ckpt checkpoints (no conversion, "
                   "no placements); with --tag, e.g. --ckpt RUN --ckpt-only --tag midtrain-kd")
    p.add_argument("--tag", default="", help="results go to edit_real.<tag>.json (default: edit_real.json)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quick:
        args.pairs, args.locality, args.calib_tokens = 4, 8, 16384
    t0 = time.perf_counter()
    out = RESULTS / ("edit_real" + (f".{args.tag}" if args.tag else "") + (".quick" if args.quick else "") + ".json")
    if args.ckpt_only:
        if not args.ckpt:
            raise SystemExit("--ckpt-only needs at least one --ckpt")
        result = {"benchmark": "edit_real", "git_commit": git_commit(), "what": "mid-trained checkpoints (--ckpt-only)",
                  "pairs": args.pairs, "locality": args.locality, "relation": "capital",
                  "midtrained": [evaluate_checkpoint(c, args) for c in args.ckpt],
                  "seconds": time.perf_counter() - t0, "threads": torch.get_num_threads()}
        return write(out, result)
    n = 30  # SmolLM2-135M
    layers = table_layers(args.table_layers, n)
    name = "full" if args.table_layers == "full" else args.table_layers.replace("/", "_").replace("+", "-")
    unseen = "" if args.calib_unseen == "pooled" else f"-{args.calib_unseen}"
    ckpt = convert(args.calib_tokens, RUN_DIR / f"smollm2-dagger-{name}-fit-{args.calib_tokens}{unseen}", layers,
                   args.calib_unseen)
    model, facts, tok = open_for_edits(ckpt)
    third = table_layers("1/3", model.cfg.n_layers)
    placements = {} if args.singles_only else {
        **({"1/3": third} if set(third) <= set(layers) else {}), args.table_layers: list(model.cfg.table_layers)}
    singles = [] if args.layers == "none" else list(model.cfg.table_layers) if args.layers == "all" else \
        [int(x) for x in args.layers.split(",")]
    if args.quick:
        singles = singles[:3]
    for extra in args.placement:
        label, _, chosen = extra.partition("=")
        placements[label] = [int(x) for x in chosen.split(",")]
    placements.update({str(i): [i] for i in singles})
    result = {"benchmark": "edit_real", "git_commit": git_commit(), "model": "SmolLM2-135M-Instruct (GGUF Q4_1)",
              "table_spec": args.table_layers, "table_layers": layers, "calib_tokens": args.calib_tokens,
              "calib_unseen": args.calib_unseen, "strategy": args.strategy, "align": args.align,
              "protect_shared": args.protect_shared,
              "pairs": args.pairs, "locality": args.locality,
              "relation": "capital", "dense_known": dense_known(model, tok, facts),
              "placements": evaluate_placements(model, tok, facts, placements, args),
              "midtrained": [evaluate_checkpoint(c, args) for c in args.ckpt],
              "seconds": time.perf_counter() - t0, "threads": torch.get_num_threads()}
    write(out, result)


def write(out: Path, result: dict) -> None:
    """The result JSON, atomically."""
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, json.dumps(result, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
