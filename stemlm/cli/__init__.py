"""The ``stemlm`` command: a thin table from subcommand to a module with ``add_arguments``/``run``.

Each subcommand lives in its own module and is imported only when used, so ``stemlm info`` does
not pay for importing the training or Hugging Face stacks. Library code never parses argv.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS: dict[str, tuple[str, str]] = {
    "info": ("stemlm.cli.info", "parameters, FLOPs, bytes per decode step and STEM layer placement of a model"),
    "convert": ("stemlm.cli.convert", "convert a Hugging Face Llama checkpoint to stemlm, or a dense stemlm model back"),
    "data": ("stemlm.cli.data", "prepare the default offline corpus and tokenizer"),
    "train": ("stemlm.cli.train", "train a dense / STEM / Hash-MoE model (the main job)"),
    "eval": ("stemlm.cli.eval", "accuracy on benchmarks (ARC, MMLU, ...), knowledge probes and needle retrieval"),
    "eval-ppl": ("stemlm.cli.eval_ppl", "perplexity of a checkpoint on the validation split"),
    "generate": ("stemlm.cli.generate", "generate text with tables on device, host RAM or disk"),
    "plan": ("stemlm.cli.plan", "memory and transfer plan for offloaded tables"),
    "edit": ("stemlm.cli.edit", "edit knowledge by swapping/copying STEM rows and report the effect"),
    "edit-eval": ("stemlm.cli.edit_eval", "evaluate knowledge edits over a set of facts"),
    "analyze": ("stemlm.cli.analyze", "geometry of STEM tables and test-time capacity"),
    "demo": ("stemlm.cli.demo", "train a small STEM model that knows country facts and edit one by swapping rows"),
}

USER_ERRORS = (ValueError, IndexError, KeyError, FileNotFoundError, NotADirectoryError, PermissionError)


def _top_parser() -> argparse.ArgumentParser:
    lines = "\n".join(f"  {name:<10} {summary}" for name, (_, summary) in COMMANDS.items())
    return argparse.ArgumentParser(
        prog="stemlm", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="STEM (Scaling Transformers with Embedding Modules): build, train, serve, edit and study.",
        epilog=f"commands:\n{lines}\n\nRun `stemlm COMMAND --help` for the options of a command.")


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``stemlm`` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        parser = _top_parser()
        if argv and argv[0] not in ("-h", "--help"):
            parser.error(f"unknown command {argv[0]!r}; choose one of {', '.join(COMMANDS)}")
        parser.print_help()
        return 0
    name = argv[0]
    module = importlib.import_module(COMMANDS[name][0])
    parser = argparse.ArgumentParser(prog=f"stemlm {name}", description=module.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    module.add_arguments(parser)
    try:  # overrides (section.field=value) may come before or after flags
        args = parser.parse_intermixed_args(argv[1:])
    except TypeError:  # a parser with sub-commands: plain parsing
        args = parser.parse_args(argv[1:])
    try:
        return int(module.run(args) or 0)
    except USER_ERRORS as e:  # one clear line, no traceback, for bad input
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f"stemlm {name}: error: {msg}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # e.g. `stemlm plan | head`: the reader left, nothing to report
        sys.stderr.close()
        return 0
    except KeyboardInterrupt:
        print(f"stemlm {name}: interrupted", file=sys.stderr)
        return 130
