"""The harness's docstring examples run, so a broken example fails the tests.

* Doctests (``>>>``) of every harness module run with :mod:`doctest`, in this process: they are the
  pure ones.
* Every ``Example ...::`` literal block (the ones that start a Ray cluster or build sglang's objects)
  runs as a script in a fresh interpreter, from a scratch directory.

A module whose example is changed to fail, or a doctest whose printed answer is changed, fails here.
"""

from __future__ import annotations

import doctest
import importlib
import os
import pkgutil
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import harness
from harness.rundir import REPO_ROOT

pytestmark = pytest.mark.est_time(20)

#: Modules that are scripts or run inside other processes (importing them here would run them).
_NOT_IMPORTED = re.compile(r"\.__main__$|\.pythonpath\.")
_EXAMPLE = re.compile(
    r"^(?P<indent> *)Example\b[^\n]*(?:\n(?P=indent)[^\n]*)*?::\n\n(?P<body>(?:(?P=indent) {4}[^\n]*\n|\n)+)", re.M
)


def _modules() -> list[str]:
    return sorted(
        m.name for m in pkgutil.walk_packages(harness.__path__, "harness.") if not _NOT_IMPORTED.search(m.name)
    )


def examples(source: str) -> list[str]:
    """The code of each ``Example ...::`` literal block of ``source``, dedented."""
    return [textwrap.dedent(m.group("body")) for m in _EXAMPLE.finditer(source)]


def _example_cases() -> list[tuple[str, str]]:
    cases = []
    for path in sorted((REPO_ROOT / "harness").rglob("*.py")):
        for i, code in enumerate(examples(path.read_text(encoding="utf-8")), 1):
            cases.append((f"{path.relative_to(REPO_ROOT)}#{i}", code))
    return cases


def test_every_doctest_of_the_harness_passes():
    tried = 0
    failed = []
    for name in _modules():
        result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
        tried += result.attempted
        if result.failed:
            failed.append(f"{name}: {result.failed} of {result.attempted} failed")
    assert not failed, "\n".join(failed)
    assert tried >= 5, f"only {tried} doctest examples found"


@pytest.mark.parametrize(("where", "code"), _example_cases(), ids=[w for w, _ in _example_cases()])
def test_each_example_runs(where: str, code: str, tmp_path: Path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, f"the example of {where} fails:\n{done.stderr[-3000:]}"


def test_the_examples_are_found():
    found = {where.split("#")[0] for where, _ in _example_cases()}
    assert {"harness/workers/__init__.py", "harness/cluster/cluster.py", "harness/engines/sim/decode_side.py"} <= found
    assert examples("Example::\n\n    x = 1\n    y = 2\n\nAfter.\n") == ["x = 1\ny = 2\n\n"]
