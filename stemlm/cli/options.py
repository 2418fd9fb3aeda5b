"""argparse value types with a range: a bad value is refused while parsing, naming the option.

``type=positive_int`` etc.; argparse reports ``argument --pairs: 0 is not a positive integer``.
"""

from __future__ import annotations

import argparse
import math


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
