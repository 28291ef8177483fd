"""Which sglang is under test: ``TARGET`` (``--sglang`` / ``HARNESS_SGLANG``: installed, a release, a tree or a
wheel), resolved and put first on the import path on first use; a target the harness cannot drive raises a
one-line :class:`~harness.targets.sglang.selection.TargetError`.

Modules: ``selection`` (resolve, activate), ``resolve`` (installs of releases and wheels), ``version``,
``releases`` and ``compat/`` (every per-release difference, named by capability), ``travel`` (what a joined
cluster's nodes are sent). The code that drives sglang lives in :mod:`harness.engines`.
"""

from __future__ import annotations

from typing import Any

from harness.targets.sglang import selection as _target
from harness.targets.sglang.selection import TargetError

__all__ = ["TARGET", "TargetError"]


def __getattr__(name: str) -> Any:
    # TARGET: the sglang under test, resolved from the environment and activated on first use (an
    # entry point has already selected it; a bare process gets $HARNESS_SGLANG or the installed one).
    if name == "TARGET":
        return _target.current()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
