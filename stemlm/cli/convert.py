"""Convert a Hugging Face Llama checkpoint (directory or GGUF file) into a stemlm checkpoint, optionally
turning some layers into STEM layers; export an all-dense stemlm checkpoint back to a Llama directory;
or store the tables of a stemlm checkpoint as bf16, int8 or int4 (dequantized when rows are gathered).

examples:
  stemlm convert --from-hf smollm2 --out runs/smollm2-dense
  stemlm convert --from-hf smollm2 --out runs/smollm2-stem --ffn stem --stem-layers 1/3 --init calibrate
  stemlm convert --from-hf smollm2 --out runs/smollm2-stem-ft --ffn stem --init calibrate --calib-data my_text.txt
  stemlm convert --from-hf smollm2 --out runs/smollm2-stem-kd --ffn stem --init calibrate --distill-steps 100
  stemlm convert --from-hf smollm2 --out runs/smollm2-dagger --ffn stem_dagger --init zero   # exactly the dense model
  stemlm convert --from-hf smollm2 --out runs/smollm2-blend --ffn stem_dagger --init calibrate --calib-dagger-rows fit
  stemlm convert --from-hf path/to/llama --out runs/llama-stem --ffn stem_dagger --stem-layers 2,5 --init random
  stemlm convert --to-hf --ckpt runs/smollm2-dense --out exported/llama
  stemlm convert --ckpt runs/default --table-dtype int8 --out runs/default-int8
  stemlm convert --from-hf smollm2 --out runs/smollm2-stem-int8 --ffn stem --table-dtype int8
"""

from __future__ import annotations

import argparse

from ..config import TABLE_INITS
from ..ffn import DENSE, KINDS, ffn_kind
from ..insert.calibrate import LAYER_CHOICES, CalibrationConfig
from ..insert.distill import PRECISIONS, ROW_UPDATES
from ..insert.fit import METHODS, UNSEEN
from ..interop.convert import INITS
from ..model.quant import TABLE_DTYPES
from .options import add_checkpoint_argument, non_empty, non_negative_int, positive_int


def _convertible_kind(name: str) -> str:
    """``--ffn``: a kind a dense Llama converts into; a known kind that does not is refused with its reason
    (other names fall through to argparse's list of choices)."""
    from ..interop.convert import _check_from_dense

    if name in KINDS and not KINDS[name].from_dense:
        try:
            _check_from_dense(name)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return name


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``stemlm convert``."""
    way = parser.add_mutually_exclusive_group()
    way.add_argument("--from-hf", metavar="DIR", help="Llama model directory to convert, or 'smollm2' for the pinned "
                     "SmolLM2-135M-Instruct GGUF")
    way.add_argument("--to-hf", action="store_true", help="export the all-dense stemlm checkpoint --ckpt as a Llama directory")
    parser.add_argument("--gguf", metavar="FILE", help="with --from-hf DIR: a GGUF file (path, or name inside DIR)")
    add_checkpoint_argument(parser, required=False, help="stemlm checkpoint or training run directory: with --to-hf, "
                            "the model to export; alone (with --table-dtype), the model whose tables to re-encode")
    parser.add_argument("--out", metavar="DIR", required=True, help="output directory (written atomically)")
    parser.add_argument("--ffn", type=_convertible_kind, choices=[name for name, kind in KINDS.items() if kind.from_dense],
                        default=DENSE, help="FFN kind of the converted layers (default: dense, an exact copy; the "
                        "n-gram kinds ngram, ngram_dagger and engram do not convert: train them)")
    parser.add_argument("--stem-layers", type=non_empty, metavar="SPEC", help="layers to convert: '1/3', '1/2', 'full' or '2,5' "
                        "(default with a STEM --ffn: 1/3)")
    parser.add_argument("--init", choices=list(INITS), default="project",
                        help="table init: 'calibrate' = rows fitted to the dense model's activations over calibration "
                        "text (one streamed pass; see docs/insertion.md), 'project' = embedding through the layer's "
                        "up- (or gate-) projection, 'zero' (with stem_dagger: exactly the dense model), "
                        "'random' = --table-init (default: project)")
    calib = parser.add_argument_group("calibration (--init calibrate)")
    calib.add_argument("--calib-data", metavar="DIR|FILE|mixed|wide", help="calibration text: a prepared data dir in "
                       "the model's vocabulary, raw text (file or directory of .txt/.md/.jsonl), 'mixed' (a third each "
                       "of the offline corpus, news and stories from a pinned package), 'wide' (the offline corpus "
                       "and each of the wide corpus's seven text sources in equal shares) or 'wide-except:A,B' (the "
                       "same less sources A and B, e.g. python-docs); default: the offline corpus")
    calib.add_argument("--calib-tokens", type=positive_int, default=CalibrationConfig.tokens,
                       help="calibration tokens, in windows spread evenly over the text (default: %(default)s)")
    calib.add_argument("--calib-seq-len", type=positive_int, default=CalibrationConfig.seq_len,
                       help="calibration window length (default: %(default)s)")
    calib.add_argument("--calib-method", choices=METHODS, default=CalibrationConfig.method,
                       help="row fit: gated = mean of W_u x weighted by SiLU(W_g x)^2 (least squares of the gated "
                       "product), mean = plain mean, down = least squares through the down-projection, zero "
                       "(default: %(default)s)")
    calib.add_argument("--calib-unseen", choices=UNSEEN, default=CalibrationConfig.unseen,
                       help="row of ids the calibration text never shows: pooled = the fit over all contexts, zero "
                       "(default: %(default)s)")
    calib.add_argument("--calib-parallel", action="store_true",
                       help="fit every layer on the dense model's own activations (default: layer by layer, each on "
                       "the activations of the layers converted before it)")
    calib.add_argument("--calib-refit-down", action=argparse.BooleanOptionalAction, default=CalibrationConfig.refit_down,
                       help="also refit each STEM layer's down-projection by least squares (default: %(default)s)")
    calib.add_argument("--calib-shrink", type=float, default=CalibrationConfig.shrink,
                       help="pseudo-contexts of the pooled fit added to every seen id, so rows of rarely seen ids lean "
                       "towards the pooled row (default: %(default)s)")
    calib.add_argument("--calib-als-rounds", type=non_negative_int, default=CalibrationConfig.als_rounds,
                       help="rounds of alternating least squares after the fit: rows given W_d, then W_d given the "
                       "rows (refits W_d; default: %(default)s)")
    calib.add_argument("--calib-correct-drift", action=argparse.BooleanOptionalAction,
                       default=CalibrationConfig.correct_drift,
                       help="layer by layer: the W_d refit and local distillation aim at the dense model's own residual "
                       "stream after each converted layer, undoing the drift of the layers converted before it, not at "
                       "the dense layer's output on the drifted inputs (default: %(default)s)")
    distill = parser.add_argument_group("local distillation (--init calibrate)")
    distill.add_argument("--distill-steps", type=non_negative_int, default=CalibrationConfig.distill_steps,
                         help="Adam steps per converted layer that train its rows (of the ids the calibration saw) "
                         "to reproduce the dense layer's output on the calibration pass's inputs; 0 = off "
                         "(default: %(default)s)")
    distill.add_argument("--distill-lr", type=float, default=CalibrationConfig.distill_lr,
                         help="learning rate of local distillation, decayed linearly to a tenth (default: %(default)s)")
    distill.add_argument("--distill-batch", type=positive_int, default=CalibrationConfig.distill_batch,
                         help="tokens per local-distillation step (default: %(default)s)")
    distill.add_argument("--distill-down", action=argparse.BooleanOptionalAction, default=CalibrationConfig.distill_down,
                         help="also train W_d of the converted layers while distilling (default: %(default)s)")
    distill.add_argument("--distill-gate", action=argparse.BooleanOptionalAction,
                         default=CalibrationConfig.distill_gate,
                         help="also train W_g of the converted layers while distilling: the whole layer then fits "
                         "ids the calibration showed rarely, not only their rows (default: %(default)s)")
    distill.add_argument("--distill-rows", choices=ROW_UPDATES, default=CalibrationConfig.distill_rows,
                         help="how the rows take local distillation's Adam steps: dense (torch's Adam on every row "
                         "each step), catchup (the same update computed for the rows the minibatch touched only, the "
                         "steps a row skipped applied when it is next read: a step's cost grows with its tokens, not "
                         "with the rows) or lazy (per-row Adam on the touched rows: a row the minibatches skip does "
                         "not move; another update) (default: %(default)s)")
    distill.add_argument("--distill-precision", choices=PRECISIONS, default=CalibrationConfig.distill_precision,
                         help="local distillation's GEMMs: fp32, bf16 (autocast; weights, moments and target stay "
                         "fp32) or auto (bf16 on CUDA or a CPU with native bf16 instructions, else fp32) "
                         "(default: %(default)s)")
    calib.add_argument("--layer-choice", choices=LAYER_CHOICES, default=CalibrationConfig.layer_choice,
                       help="with a ratio --stem-layers (1/3, 1/2, full): 'cheapest' converts that many layers, the ones "
                       "whose fitted rows cost the dense model least (each measured alone, one pass); 'uniform' the "
                       "placement's own evenly spaced layers (default: %(default)s)")
    calib.add_argument("--calib-dagger-rows", choices=["zero", "fit"], default="zero",
                       help="--ffn stem_dagger tables: zero (exactly the dense model) or fit (the calibrated STEM rows, "
                       "the start of gradual insertion with `stemlm train run.anneal=blend`) (default: %(default)s)")
    calib.add_argument("--calib-device", default=CalibrationConfig.device,
                       help="where the calibration pass runs: auto (the GPU if there is one), cpu, cuda, cuda:N "
                       "(default: %(default)s)")
    parser.add_argument("--table-init", choices=TABLE_INITS, help="distribution of --init random tables "
                        "(default: the config default, xavier_normal)")
    parser.add_argument("--seed", type=non_negative_int, default=0, help="seed of --init random tables (default: 0)")
    parser.add_argument("--table-dtype", choices=TABLE_DTYPES, default=None,
                        help="store the STEM tables as fp32, bf16, int8 (absmax scale per group of 64) or int4 (absmax "
                             "scale per group of 32); with --from-hf or alone with --ckpt (default: fp32 / as stored)")


def run(args: argparse.Namespace) -> int:
    """Convert in the direction asked for and print where the result went."""
    from ..interop.convert import convert_from_hf, convert_to_hf

    if args.to_hf or args.from_hf is None:
        if args.gguf or args.stem_layers or not ffn_kind(args.ffn).is_dense:
            raise ValueError("--gguf, --ffn and --stem-layers apply to --from-hf only")
        if args.ckpt is None:
            raise ValueError("give --from-hf DIR, --to-hf --ckpt DIR, or --ckpt DIR --table-dtype T")
    if args.to_hf:
        if args.table_dtype is not None:
            raise ValueError("--table-dtype does not apply to --to-hf (a Llama checkpoint has no tables)")
        out = convert_to_hf(args.ckpt, args.out)
        print(f"wrote Llama checkpoint {out}")
        return 0
    if args.from_hf is None:
        if args.table_dtype is None:
            raise ValueError("--ckpt alone needs --table-dtype (or add --to-hf to export a Llama checkpoint)")
        from ..interop.convert import convert_tables

        out = convert_tables(args.ckpt, args.out, args.table_dtype)
        print(f"wrote stemlm checkpoint {out} (tables stored as {args.table_dtype})")
        return 0
    if args.ckpt is not None:
        raise ValueError("--ckpt applies to --to-hf or to re-encoding tables, not to --from-hf")
    if ffn_kind(args.ffn).is_dense and args.stem_layers:
        raise ValueError("--stem-layers needs a STEM --ffn (stem, stem_dagger or stem_gate)")
    calibration = None
    if args.init == "calibrate":
        calibration = CalibrationConfig(method=args.calib_method, unseen=args.calib_unseen, sequential=not args.calib_parallel,
                                        refit_down=args.calib_refit_down, tokens=args.calib_tokens, seq_len=args.calib_seq_len,
                                        dagger_rows=args.calib_dagger_rows, device=args.calib_device,
                                        layer_choice=args.layer_choice,
                                        shrink=args.calib_shrink, als_rounds=args.calib_als_rounds,
                                        distill_steps=args.distill_steps,
                                        distill_lr=args.distill_lr, distill_batch=args.distill_batch,
                                        distill_down=args.distill_down, distill_gate=args.distill_gate,
                                        distill_rows=args.distill_rows, distill_precision=args.distill_precision,
                                        correct_drift=args.calib_correct_drift)
    elif args.calib_data is not None:
        raise ValueError("--calib-data applies to --init calibrate only")
    elif args.distill_steps:
        raise ValueError("--distill-steps applies to --init calibrate only")
    out = convert_from_hf(args.from_hf, args.out, args.gguf, ffn=args.ffn, stem_layers=args.stem_layers or "1/3",
                          init=args.init, table_init=args.table_init, seed=args.seed, table_dtype=args.table_dtype,
                          calibration=calibration, calib_data=args.calib_data, log=print)
    print(f"wrote stemlm checkpoint {out}")
    return 0
