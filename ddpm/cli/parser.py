"""The command line's parser: one argparse parser per mode, made from the flag table (cli/flags.py, cli/reads.py).

    args = parse_args(["--mode", "sample", "--n_samples", "4"])
    request = resolve.request_for(args)            # cli/resolve.py: flags checked, one typed request

``--mode`` is read first; the mode's parser then takes only the flags that mode reads, so
``--mode sample --help`` lists those (grouped, with defaults), ``--help`` alone lists the modes and the
flags every mode reads, and a flag the mode does not read is refused in one line naming the modes that
do (exit code 2). Building a parser imports nothing heavy: ``--help`` never loads torch.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Collection, Mapping, Sequence

from ddpm.cli.flags import FLAGS, GROUPS, READ_BY, not_read
from ddpm.cli.reads import MODE_SUMMARIES, MODES, READ_BY_RUN

PROG = "main.py"
DESCRIPTION = "Train a DDPM on small images, draw sample grids, and compare sampling implementations."


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors (exit code 2), like every other user error here."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """A flag's default after its help (unless it has none: a switch, or a default the help explains); the
    description's list of modes kept as written."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help_text = action.help or ""
        if action.default in (None, False, argparse.SUPPRESS) or "%(default)" in help_text or not action.option_strings:
            return help_text
        return f"{help_text} (default: %(default)s)" if help_text else "default: %(default)s"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The flags of ``argv`` (default: the command line) for its ``--mode``, with ``given``: the flags
    written there, told apart from argparse's defaults (what a resumed run compares with its checkpoint).
    Every flag of the table is an attribute (a flag the mode does not read holds its default)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    mode = _mode_written(argv)
    if mode is None and _asks_for_help(argv):
        overview_parser().parse_args(["--help"])  # prints the modes and the common flags, exits 0
    parser = build_parser(mode or "train")
    args, unread = parser.parse_known_args(argv)
    if unread:
        parser.error(_refusal(unread, args.mode))
    for name, spec in FLAGS.items():  # one namespace shape for every mode: resolve.py reads it whole
        if not hasattr(args, name):
            setattr(args, name, spec.options.get("default", False if _is_switch(spec.options) else None))
    for action in parser._actions:  # parsed again without defaults, only what was written is left
        action.default = argparse.SUPPRESS
    args.given = frozenset(vars(parser.parse_known_args(argv)[0]))
    return args


def build_parser(mode: str | None = None) -> argparse.ArgumentParser:
    """The parser of ``mode``'s flags, grouped as in the table; every flag of every mode when ``mode`` is None."""
    parser = Parser(
        prog=PROG,
        description=DESCRIPTION if mode is None else f"--mode {mode}: {MODE_SUMMARIES[mode]}.",
        formatter_class=HelpFormatter,
        allow_abbrev=False,  # else another mode's --warmup would set this mode's --warmup_steps
    )
    for title, flags in GROUPS:
        read = [spec for spec in flags if mode is None or mode in spec.modes]
        if read:
            group = parser.add_argument_group(title)
            for spec in read:
                group.add_argument(f"--{spec.name}", **spec.options_for(mode))
    return parser


def overview_parser() -> argparse.ArgumentParser:
    """``--help`` without a mode: the modes, and the flags every mode reads."""
    width = max(map(len, MODES))
    modes = "\n".join(f"  {mode:<{width}}  {summary}" for mode, summary in MODE_SUMMARIES.items())
    parser = Parser(
        prog=PROG,
        usage=f"{PROG} [--mode MODE] [flags]",
        description=f"{DESCRIPTION}\n\nmodes (python {PROG} --mode MODE --help lists the flags MODE reads):\n{modes}",
        formatter_class=HelpFormatter,
    )
    group = parser.add_argument_group("flags every mode reads")
    for name, modes_reading in READ_BY.items():
        if set(modes_reading) == set(MODES):
            group.add_argument(f"--{name}", **FLAGS[name].options)
    return parser


def _mode_written(argv: list[str]) -> str | None:
    """``--mode`` as written (an unknown mode is refused here, exit code 2), or None."""
    first = Parser(prog=PROG, add_help=False, allow_abbrev=False)
    first.add_argument("--mode", choices=MODES, default=None)
    return first.parse_known_args(argv)[0].mode


def _asks_for_help(argv: list[str]) -> bool:
    words = argv[: argv.index("--")] if "--" in argv else argv
    return any(word in ("-h", "--help") for word in words)


def _is_switch(options) -> bool:
    return options.get("action") == "store_true"


def not_read_by_run(mode: str, values: Mapping[str, object], given: Collection[str]) -> str | None:
    """The line refusing the first flag in ``given`` that ``mode``'s run, told apart by ``values`` (the flags' values
    by name), does not read (the flag table's READ_BY_RUN: a TensorRT flag given to an ONNX export, a sampling flag to
    --bench training); None when the run reads every flag given. cli/resolve.py raises it, after the values' checks.
    A distillation's --resume without --distill_method continues its checkpoint's method, unknown here (the default
    for the step count is not it): modes/distill.py checks those flags once it has read the checkpoint."""
    for name, (selector, readers) in READ_BY_RUN.get(mode, {}).items():
        if selector == "distill_method" and values.get("resume") and selector not in given:
            continue
        if name in given and values[selector] not in readers:
            which = " or ".join(readers)
            return (
                f"--{name} is read by --mode {mode} with --{selector} {which}, not --{selector} {values[selector]}; "
                f"pass --{selector} {which}, or drop --{name}"
            )
    return None


def _refusal(unread: list[str], mode: str) -> str:
    """The first flag ``mode`` does not read, and the modes that read it; or argparse's own words for what
    no mode reads."""
    for word in unread:
        name = word[2:].split("=", 1)[0] if word.startswith("--") else None
        if name in READ_BY:
            return not_read(name, mode)
    return f"unrecognized arguments: {' '.join(unread)}"
