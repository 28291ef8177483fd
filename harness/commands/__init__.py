"""The command-line front ends: one module per ``harness`` sub-command (``harness.cli`` lists them) and
``rerun-test`` (:mod:`.rerun`).

A sub-command module exposes ``register(subparsers)``, which adds its parser and sets ``func`` (taking
the parsed args, returning the exit code); bad input raises :class:`UsageError`.
"""


class UsageError(Exception):
    """Bad input from the user: printed as one line, exit code 2."""
