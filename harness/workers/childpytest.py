"""A pytest child: the command line and environment that rerun's groups, the fault check's runs and the
mutants' runs start pytest with.

Each such child writes a JUnit XML (``junit_family=xunit1``, which carries files) and a run directory of
its own; the caller adds its options around that core (``before`` and ``after`` the core) and starts it
(directly, or as a fork of :func:`harness.engines.fork_preload.python_command`).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Iterable, Mapping, Sequence

#: The JUnit flavour every child writes: ``xunit1`` names each case's file.
JUNIT_FAMILY = "junit_family=xunit1"


def command(
    tests: Sequence[str],
    *,
    junit: Path,
    run_dir: Path,
    before: Sequence[str] = (),
    after: Sequence[str] = (),
    python: str = sys.executable,
) -> list[str]:
    """``PYTHON -m pytest TESTS BEFORE --junitxml=JUNIT -o junit_family=xunit1 --run-dir=RUN_DIR AFTER``.

    >>> command(["suites/a.py"], junit=Path("j.xml"), run_dir=Path("r"), before=["-q"], after=["-x"], python="py")
    ['py', '-m', 'pytest', 'suites/a.py', '-q', '--junitxml=j.xml', '-o', 'junit_family=xunit1', '--run-dir=r', '-x']
    """
    return [
        python,
        "-m",
        "pytest",
        *tests,
        *before,
        f"--junitxml={junit}",
        "-o",
        JUNIT_FAMILY,
        # One argument: pytest takes each existing path among its arguments, option values included, as a
        # place to look for its rootdir, so a run directory left by an earlier run would move the rootdir
        # (a fault's second run reported its tests as ``proj/suites/...``).
        f"--run-dir={run_dir}",
        *after,
    ]


def environment(updates: Mapping[str, str] | None = None, *, drop: Iterable[str] = ()) -> dict[str, str]:
    """This process's environment without the variables ``drop`` names, plus ``updates``."""
    dropped = set(drop)
    return {**{k: v for k, v in os.environ.items() if k not in dropped}, **(updates or {})}
