"""pytest plugin concern: tests that run only when their file is named (marker ``explicit(reason)``).

A suite too slow for ``./dev test`` (a real stack a test, minutes in all) carries it: collected from a
directory (``./dev test``, ``pytest suites``) its tests are deselected; ``pytest FILE`` or
``rerun-test FILE`` runs them. ``rerun-test``'s default run leaves such a file out (:mod:`harness.rerun.registry`).
"""

from __future__ import annotations

from pathlib import Path

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "explicit(reason): run only when the test's file is named on the command line (not from a directory)"
    )


def named_files(config: pytest.Config) -> set[Path]:
    """The files the command line names (``FILE`` or ``FILE::test``), resolved against pytest's directory."""
    base = Path(config.invocation_params.dir)
    out = set()
    for arg in config.args:
        path = (base / arg.split("::", 1)[0]).resolve()
        if path.is_file():
            out.add(path)
    return out


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Deselect ``explicit`` tests whose file was not named (first: no other concern plans for them)."""
    named = named_files(config)
    dropped = [i for i in items if i.get_closest_marker("explicit") is not None and i.path.resolve() not in named]
    if dropped:
        items[:] = [i for i in items if i not in dropped]
        config.hook.pytest_deselected(items=dropped)
