"""The command-line front ends: one module per ``harness`` sub-command (``harness.cli`` lists them) and
``rerun-test`` (:mod:`.rerun`).

A sub-command module exposes ``register(subparsers)``, which adds its parser and sets ``func`` (taking
the parsed args, returning the exit code); bad input raises :class:`UsageError`. Every command and
sub-command answers ``--version`` (:func:`add_version`).
"""

from __future__ import annotations

import math
import typing

if typing.TYPE_CHECKING:
    import argparse


class UsageError(Exception):
    """Bad input from the user: printed as one line, exit code 2."""


#: The longest duration any option takes (a day): a bound every timeout and shard time keeps.
MAX_SECONDS = 86400.0


def check_seconds(value: float | None, option: str) -> None:
    """Refuse a duration that is not finite or not in (0, :data:`MAX_SECONDS`] (``--timeout nan`` never times out).

    >>> check_seconds(float("nan"), "--timeout")
    Traceback (most recent call last):
    harness.commands.UsageError: --timeout nan: must be a finite number of seconds above 0 and at most 86400
    """
    if value is not None and not (math.isfinite(value) and 0 < value <= MAX_SECONDS):
        raise UsageError(f"{option} {value:g}: must be a finite number of seconds above 0 and at most {MAX_SECONDS:g}")


def version_text(prog: str) -> str:
    """``<prog> <version> (pd-harness, commit <sha>[, uncommitted changes])``: what ``--version`` prints."""
    import importlib.metadata

    from harness.report.stamp import git_state
    from harness.rundir import REPO_ROOT

    try:
        version = importlib.metadata.version("pd-harness")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    sha, dirty = git_state(REPO_ROOT)
    commit = sha[:12] if sha != "unknown" else "not a git checkout"
    return f"{prog} {version} (pd-harness, commit {commit}{', uncommitted changes' if dirty else ''})"


def add_version(parser: argparse.ArgumentParser, prog: str) -> None:
    """Give ``parser`` a ``--version`` option that prints :func:`version_text` and exits 0 (computed
    only when asked: it runs git)."""
    import argparse

    class _Version(argparse.Action):
        def __init__(self, option_strings: list[str], dest: str, **kwargs: object) -> None:
            super().__init__(
                option_strings,
                dest,
                nargs=0,
                default=argparse.SUPPRESS,
                help="print the harness version and commit, and exit",
            )

        def __call__(self, parser: argparse.ArgumentParser, *args: object, **kwargs: object) -> None:
            print(version_text(prog))
            parser.exit(0)

    parser.add_argument("--version", action=_Version)
