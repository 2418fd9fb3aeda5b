"""What the commands share on their command line, written once: argparse value types, and the option groups.

* value types with a range (``type=positive_int`` ...): a bad value is refused while parsing,
  naming the option (``argument --pairs: 0 is not a positive integer``);
* ``add_checkpoint_argument``: ``--ckpt`` (alias ``--model``), the checkpoint or run a command reads;
* ``add_placement_arguments`` / ``placement_from_args``: where the STEM tables live (``--tables``,
  ``--tables-file``, ``--table-dtype``, ``--cache-rows``, ``--cache-window``, ``--prefetch``,
  ``--device``) and the ``stemlm.store.Placement`` they make;
* ``--tokenizer``, ``--no-verify``, ``--matmul``, ``--graphs``.

Every command that opens a model takes the same options from here, so they mean the same everywhere.
"""

from __future__ import annotations

import argparse
import math
import sys


def _number(kind, text: str, what: str):
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
    if isinstance(value, float) and not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
    return value


def _ranged(kind, what: str, ok):
    def parse(text: str):
        value = _number(kind, text, what)
        if not ok(value):
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
        return value

    parse.__name__ = what  # argparse names the type in some messages
    return parse


positive_int = _ranged(int, "a positive integer", lambda v: v >= 1)
non_negative_int = _ranged(int, "an integer >= 0", lambda v: v >= 0)
positive_float = _ranged(float, "a positive finite number", lambda v: v > 0)
non_negative_float = _ranged(float, "a finite number >= 0", lambda v: v >= 0)
fraction = _ranged(float, "a number in [0, 1]", lambda v: 0 <= v <= 1)
open_fraction = _ranged(float, "a number in [0, 1)", lambda v: 0 <= v < 1)
probability = _ranged(float, "a number in (0, 1]", lambda v: 0 < v <= 1)


def non_empty(text: str) -> str:
    """A string with something in it (``--stem-layers ''`` is refused)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty value is not allowed")
    return text


# -- the checkpoint ------------------------------------------------------------------------------
def add_checkpoint_argument(parser, required: bool = True, multiple: bool = False,
                            help: str = "checkpoint directory or training run directory (its newest checkpoint)") -> None:
    """``--ckpt`` and its alias ``--model`` (the name vLLM and lm-eval give it): ``args.ckpt``, a list with
    ``multiple`` (the option repeated)."""
    parser.add_argument("--ckpt", "--model", dest="ckpt", metavar="CKPT", required=required,
                        action="append" if multiple else "store", default=None,
                        help=f"{help}; --model is an alias" + ("" if required else " (default: none)"))


def add_tokenizer_argument(parser) -> None:
    """``--tokenizer``: a tokenizer file or directory instead of the checkpoint's own."""
    parser.add_argument("--tokenizer", default=None,
                        help="tokenizer file or directory (default: the checkpoint's or its run's)")


def add_verify_argument(parser) -> None:
    """``--no-verify``: skip the checksum manifest (``args.verify``)."""
    parser.add_argument("--no-verify", dest="verify", action="store_false",
                        help="skip checking the checkpoint's files against its checksum manifest (default: check)")


# -- where the tables live ------------------------------------------------------------------------
class _DeprecatedAlias(argparse.Action):
    """An old spelling of an option: sets the new option's value and says it is deprecated."""

    def __init__(self, option_strings, dest, instead: str = "", **kwargs):
        self.instead = instead
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"{parser.prog}: {option_string} is deprecated; use {self.instead}", file=sys.stderr)
        setattr(namespace, self.dest, values)


def add_placement_arguments(parser, deprecated_tier: bool = False) -> None:
    """The options that make a ``stemlm.store.Placement`` (``placement_from_args(args)``); ``deprecated_tier``
    also accepts ``--tier`` (what ``stemlm serve`` called ``--tables`` before)."""
    from ..store.tiers import TIERS

    group = parser.add_argument_group("where the STEM tables live (docs/offload.md)")
    group.add_argument("--tables", choices=TIERS, default=TIERS[0],
                       help="where the STEM tables live: model memory, host RAM, or a file on disk")
    if deprecated_tier:
        group.add_argument("--tier", dest="tables", choices=TIERS, default=argparse.SUPPRESS, action=_DeprecatedAlias,
                           instead="--tables", help="deprecated: the old name of --tables (whose default applies)")
    group.add_argument("--tables-file", default=None,
                       help="safetensors file holding the tables (default: the checkpoint's model.safetensors)")
    add_table_dtype_argument(group)
    group.add_argument("--cache-rows", type=non_negative_int, default=0,
                       help="hot-row LFU cache size per table (host/disk tiers)")
    group.add_argument("--cache-window", type=open_fraction, default=0.0,
                       help="fraction of the cache kept as an LRU admission window (W-TinyLFU; default 0 = plain LFU)")
    group.add_argument("--prefetch", action=argparse.BooleanOptionalAction, default=True,
                       help="gather the rows of a forward on a background worker (host/disk tiers)")
    group.add_argument("--device", default="cpu", help="compute device: cpu | cuda | cuda:N | auto")


def placement_fields(args) -> dict:
    """The options of ``add_placement_arguments`` as ``Placement`` fields: ``tier``, ``device`` (resolved)
    and ``table_dtype`` always, the others where they differ from their defaults."""
    from ..runtime.devices import resolve_device

    defaults = {"tables_file": None, "cache_rows": 0, "cache_window": 0.0, "prefetch": True}
    fields = {"tier": args.tables, "device": str(resolve_device(args.device)), "table_dtype": args.table_dtype}
    return {**fields, **{k: getattr(args, k) for k, v in defaults.items() if getattr(args, k) != v}}


def placement_from_args(args):
    """The ``stemlm.store.Placement`` of the options of ``add_placement_arguments`` (the device resolved)."""
    from ..store.placement import Placement

    return Placement(**placement_fields(args))


# -- compute ---------------------------------------------------------------------------------------
def add_matmul_argument(parser, default: str = "auto") -> None:
    """``--matmul auto|aten|onednn``: the GEMM kernels (``stemlm.runtime.matmul``)."""
    from ..runtime.matmul import BACKENDS

    parser.add_argument("--matmul", choices=BACKENDS, default=default,
                        help=f"GEMM kernels: auto (oneDNN for fp32 on CPU, else aten) | aten | onednn (default: {default})")


def add_table_dtype_argument(parser: argparse.ArgumentParser) -> None:
    """``--table-dtype``: how the STEM tables are held while serving (re-encoded at load on host/device)."""
    from ..model.quant import TABLE_DTYPES

    parser.add_argument("--table-dtype", choices=TABLE_DTYPES, default=None,
                        help="hold the STEM tables as fp32, bf16, int8 or int4, dequantized when rows are gathered; "
                             "re-encoded at load for the device and host tiers (the disk tier serves the file as "
                             "stored: convert it first with `stemlm convert --ckpt C --table-dtype T`); "
                             "default: as stored")


def add_graphs_argument(parser: argparse.ArgumentParser) -> None:
    """``--graphs``: the decode step (``stemlm.inference.core``): CUDA graphs, eager, or static shapes."""
    from ..inference.static import GRAPH_MODES

    parser.add_argument("--graphs", choices=GRAPH_MODES, default="auto",
                        help="decode step: 'auto' captures CUDA graphs on a CUDA device (static KV cache, padded "
                             "batch buckets) and runs eagerly elsewhere; 'on' insists on graphs; 'off' runs "
                             "eagerly; 'static' runs the graphs' static shapes without capturing (any device)")
