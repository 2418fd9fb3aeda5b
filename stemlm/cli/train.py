"""Train a dense / STEM / Hash-MoE model (the main job).

With no arguments: builds the default corpus if it is missing, trains the default small STEM
model (tiny preset, STEM in 1/3 of the layers) into runs/default, resuming it if it is already
there, and prints its validation loss next to the unigram entropy of the corpus.

Settings resolve as: preset defaults -> --config YAML -> the flags below -> section.field=value
overrides. The final config is written to <run.out>/config.yaml.

examples:
  stemlm train                                       # the default run (a few minutes on 2 cores)
  stemlm train --preset debug --steps 20 --out runs/debug
  stemlm train --ffn dense --out runs/dense          # the dense baseline of the default run
  stemlm train --compare dense                       # STEM and dense, same budget, both val losses
  stemlm train --data my_data --ffn stem_dagger --stem-layers 1/2 optim.lr=1e-3 run.dtype=bfloat16
  stemlm train --data notes/ --preset debug          # raw .txt/.md/.jsonl: tokenized once into the cache
  stemlm train --out runs/debug --resume             # continue the newest checkpoint exactly
  stemlm train --config runs/debug/config.yaml --resume --allow-change optim.lr optim.lr=3e-4
                                                     # continue with a named config change
  stemlm train run.stage=midtrain run.init_from=runs/converted model.max_seq_len=512
  python -m stemlm.train ...                         # the same command
"""

from __future__ import annotations

import argparse
import os
import sys

from ..ffn import FFN_KINDS
from ..presets import PRESETS
from .options import non_empty, positive_int


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ..train.config import describe_fields

    parser.add_argument("--preset", default=None, choices=list(PRESETS),
                        help="model shape and its recommended run settings (default: tiny; debug = seconds-long run)")
    parser.add_argument("--ffn", default=None, choices=FFN_KINDS, help="FFN kind of the chosen layers (default: stem)")
    parser.add_argument("--stem-layers", type=non_empty, default=None, help="placement: '1/3' (default), '1/2', 'full', 'none' or '2,5'")
    parser.add_argument("--data", default=None,
                        help="a prepared data dir, or raw text (.txt/.md/.jsonl file or a dir of them) that is "
                             "prepared once into the cache with a BPE of model.vocab_size (default 4096) tokens; "
                             "default: the default corpus, built if missing")
    parser.add_argument("--steps", type=positive_int, default=None, help="optimizer steps (= run.steps; default: the preset's, 300 for tiny)")
    parser.add_argument("--out", default=None, help="run directory (= run.out, default runs/default)")
    parser.add_argument("--resume", action="store_true", help="continue from the newest checkpoint of the run directory")
    parser.add_argument("--allow-change", action="append", default=[], metavar="FIELD",
                        help="with --resume: let this optim.*/data.* field differ from the checkpoint's config "
                             "(repeat the flag for several; recorded in metrics.jsonl and config.yaml; default: none)")
    parser.add_argument("--config", default=None, metavar="FILE.yaml", help="YAML with any of the sections below (default: none)")
    parser.add_argument("--stop-at", type=positive_int, default=None, metavar="N",
                        help="pause after step N with a checkpoint (the schedule still spans run.steps; default: run to the end)")
    parser.add_argument("--compare", default=None, choices=FFN_KINDS, metavar="KIND",
                        help="also train model.ffn=KIND with the same budget into <out>-KIND and print both")
    parser.add_argument("overrides", nargs="*", metavar="section.field=value", help="config overrides (listed below)")
    parser.epilog = "config overrides (section.field=default  meaning):\n" + describe_fields()


def _flag_overrides(args) -> list[str]:
    pairs = [("model.ffn", args.ffn), ("model.stem_layers", args.stem_layers), ("data.dir", args.data),
             ("run.steps", args.steps), ("run.out", args.out)]
    return [f"{k}={v}" for k, v in pairs if v is not None]


def run(args) -> int:
    from ..train import TrainingDiverged, load_train_config, train
    from ..train.build import resolve_data_dir
    from ..runtime.devices import resolve_device
    from ..train.report import next_steps_lines, summary_lines, unigram_entropy

    default_run = not _given(args)
    overrides = _flag_overrides(args) + list(args.overrides)
    cfg = load_train_config(args.preset, args.config, overrides)
    resolve_device(cfg.run.device, "run.device")  # a missing GPU fails now, not after the corpus is built
    runs = {args.ffn or cfg.model.ffn or "stem": cfg}
    if args.compare:
        runs[args.compare] = load_train_config(args.preset, args.config, overrides + [
            f"model.ffn={args.compare}", f"run.out={cfg.run.out.rstrip('/')}-{args.compare}"])
    # Build the default corpus (or prepare raw --data) once, up front: every run then names the prepared dir.
    cfg.data.dir = str(resolve_data_dir(cfg))
    for other in runs.values():
        other.data.dir = cfg.data.dir
    results = {}
    try:
        for label, run_cfg in runs.items():
            results[label] = train(run_cfg, resume=args.resume or default_run, stop_at=args.stop_at,
                                   allow_changes=tuple(args.allow_change))
    except (TrainingDiverged, FileExistsError) as e:
        print(f"stemlm train: error: {e}", file=sys.stderr)
        return 1
    if os.environ.get("RANK", "0") == "0":  # under torchrun only rank 0 reports
        unigram = unigram_entropy(cfg.data.dir)
        for r in results.values():
            if r.finished_before:
                print(f"{r.run_dir} is already finished ({r.steps} steps): nothing was trained or changed; "
                      f"its stored result follows")
        print("\n".join(summary_lines(results, unigram)))
        if len(results) > 1 and cfg.run.plots:
            from ..train.plots import plot_run
            files = plot_run(cfg.run.out, {k: r.run_dir for k, r in results.items()}, unigram, prefix="compare_")
            print(f"comparison plots: {', '.join(str(f) for f in files)}")
        for label, r in results.items():
            print("\n".join(next_steps_lines(r, runs[label].model.ffn or label)))
    return 0


def _given(args) -> bool:
    """True when any option or override was given (the no-argument run resumes automatically)."""
    return bool(_flag_overrides(args) or args.overrides or args.preset or args.resume or args.config
                or args.stop_at or args.compare or args.allow_change)
