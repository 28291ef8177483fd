"""The ``harness`` command: one sub-command per concern, each in ``harness/commands/<name>.py``.

A command module exposes ``register(subparsers)`` which adds its parser and sets ``func`` (taking the
parsed args, returning the exit code). Bad input gets one ``harness: ...`` line on stderr and exit 2.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from harness.commands import UsageError

# Sub-command modules, in help order. Add a line here when a concern gains a command.
COMMANDS = (
    "harness.commands.topology",
    "harness.commands.doctor",
    "harness.commands.faults",
    "harness.commands.gate",
    "harness.commands.flaky",
    "harness.commands.matrix",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="harness", description="PD-disaggregation test harness")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in COMMANDS:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except UsageError as e:
        print(f"harness: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("harness: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
