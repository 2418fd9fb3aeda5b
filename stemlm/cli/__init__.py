"""The ``stemlm`` command: a thin table from subcommand to a module with ``add_arguments``/``run``.

Each subcommand lives in its own module and is imported only when used, so ``stemlm info`` does
not pay for importing the training or Hugging Face stacks. Library code never parses argv.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from ..runtime.files import SaveError

COMMANDS: dict[str, tuple[str, str]] = {
    "info": ("stemlm.cli.info", "parameters, FLOPs, bytes per decode step and STEM layer placement of a model"),
    "convert": ("stemlm.cli.convert", "convert a Hugging Face Llama checkpoint to stemlm, or a dense stemlm model back"),
    "data": ("stemlm.cli.data", "prepare the default offline corpus and tokenizer"),
    "train": ("stemlm.cli.train", "train a dense / STEM / Hash-MoE model (the main job)"),
    "eval": ("stemlm.cli.eval", "accuracy on benchmarks (ARC, MMLU, ...), knowledge probes and needle retrieval"),
    "eval-ppl": ("stemlm.cli.eval_ppl", "perplexity of a checkpoint on the validation split"),
    "generate": ("stemlm.cli.generate", "generate text with tables on device, host RAM or disk"),
    "serve": ("stemlm.cli.serve", "serve a model over an OpenAI-compatible HTTP API with continuous batching"),
    "plan": ("stemlm.cli.plan", "memory and transfer plan for offloaded tables"),
    "edit": ("stemlm.cli.edit", "edit knowledge by swapping/copying STEM rows and report the effect"),
    "edit-eval": ("stemlm.cli.edit_eval", "evaluate knowledge edits over a set of facts"),
    "analyze": ("stemlm.cli.analyze", "geometry of STEM tables, test-time capacity, n-gram slot occupancy"),
    "study": ("stemlm.cli.study", "run the STEM study (comparison, stability, context, mid-training) and its report"),
    "demo": ("stemlm.cli.demo", "train a small STEM model that knows country facts and edit one by swapping rows"),
}

USER_ERRORS = (ValueError, IndexError, KeyError, FileNotFoundError, NotADirectoryError, PermissionError, SaveError)


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the description's line breaks and adds ``(default: X)`` to every option whose help
    does not state its default already (flags, required options and members of a required
    either-or group have none)."""

    no_default: frozenset = frozenset()  # ids of the actions of required mutually exclusive groups

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (not action.option_strings or action.nargs == 0 or action.required or id(action) in self.no_default
                or action.default is argparse.SUPPRESS or "default" in text.lower()):
            return text
        return f"{text} (default: {'none' if action.default is None else '%(default)s'})"


class ArgumentParser(argparse.ArgumentParser):
    """argparse with the house conventions: a bad option is one stderr line and exit status 2, and
    ``--help`` shows every default (``HelpFormatter``)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")

    def _get_formatter(self):
        formatter = super()._get_formatter()
        formatter.no_default = frozenset(id(a) for g in self._mutually_exclusive_groups if g.required
                                         for a in g._group_actions)
        return formatter


def _top_parser() -> argparse.ArgumentParser:
    lines = "\n".join(f"  {name:<10} {summary}" for name, (_, summary) in COMMANDS.items())
    parser = ArgumentParser(
        prog="stemlm", description="STEM (Scaling Transformers with Embedding Modules): build, train, serve, edit and study.",
        epilog=f"commands:\n{lines}\n\nRun `stemlm COMMAND --help` for the options of a command.")
    parser.add_argument("-V", "--version", action="store_true", help="print the version (and git commit) and exit")
    return parser


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    try:  # overrides (section.field=value) may come before or after flags
        return parser.parse_intermixed_args(argv)
    except TypeError:  # a parser with sub-commands: plain parsing
        return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``stemlm`` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-V", "--version"):
        from ..version import version_string

        print(version_string())
        return 0
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        parser = _top_parser()
        if argv and argv[0] not in ("-h", "--help"):
            print(f"stemlm: error: unknown command {argv[0]!r}; choose one of {', '.join(COMMANDS)}", file=sys.stderr)
            return 2
        parser.print_help()
        return 0
    name = argv[0]
    module = importlib.import_module(COMMANDS[name][0])
    parser = ArgumentParser(prog=f"stemlm {name}", description=module.__doc__)
    module.add_arguments(parser)
    try:
        args = _parse(parser, argv[1:])
    except SystemExit as e:  # a bad option was reported in one line: return its status (--help exits as usual)
        if e.code in (0, None):
            raise
        return int(e.code)
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
