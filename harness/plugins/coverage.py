"""pytest plugin concern: label the target's measured lines with the test that ran them.

When the run measures the target (``rerun-test --coverage``: :mod:`harness.changes.measure` started
coverage.py in this process through its own start-up hook), each test's phases run under the dynamic
context of its node id, so a line this process executes during a test is attributed to that test;
lines executed between tests (session fixtures, collection) keep the group's static context.

Why not pytest-cov's ``--cov-context=test``: pytest-cov also owns starting, combining and reporting the
data, which here spans the group's servers and Ray workers and several groups of one run; coverage.py
starts itself in every one of those processes, and this concern only names the tests.
"""

from __future__ import annotations

from typing import Generator

import pytest

from harness.changes import measure


def label(item: pytest.Item) -> str:
    """The test's context: its node id with the file relative to the directory pytest was started in,
    or absolute when the file lies outside it (a node id is relative to the rootdir, which pytest picks
    from its arguments): a label ``harness mutate`` passes to a pytest started in the same directory."""
    name = item.nodeid.split("::", 1)[1] if "::" in item.nodeid else ""
    try:
        path = item.path.relative_to(item.config.invocation_params.dir).as_posix()
    except ValueError:
        path = str(item.path)
    return f"{path}::{name}" if name else path


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, None, None]:  # noqa: ARG001
    cov = measure.running()
    if cov is not None:
        cov.switch_context(label(item))
    try:
        yield
    finally:
        if cov is not None:
            cov.switch_context("")
