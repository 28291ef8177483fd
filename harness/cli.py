"""The ``harness`` command: one sub-command per concern, each in ``harness/commands/<name>.py``.

A command module exposes ``register(subparsers)`` which adds its parser and sets ``func`` (taking the
parsed args, returning the exit code). Bad input gets one ``harness: ...`` line on stderr and exit 2;
``--version`` works on every command.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from harness.commands import UsageError, add_version
from harness.workers.procs import StateError

# Sub-command modules, in help order. Add a line here when a concern gains a command.
COMMANDS = (
    "harness.commands.topology",
    "harness.commands.doctor",
    "harness.commands.faults",
    "harness.commands.gate",
    "harness.commands.flaky",
    "harness.commands.matrix",
    "harness.commands.mutate",
    "harness.commands.runs",
    "harness.commands.explore",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="harness", description="PD-disaggregation test harness")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in COMMANDS:
        importlib.import_module(name).register(sub)
    _versioned(parser)
    return parser


def _versioned(parser: argparse.ArgumentParser) -> None:
    """``--version`` on the command and on every sub-command below it."""
    add_version(parser, "harness")
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in dict.fromkeys(action.choices.values()):
                _versioned(child)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # the command line, as run records say it
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    try:
        return int(args.func(args) or 0)
    except (UsageError, StateError) as e:
        print(f"harness: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("harness: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
