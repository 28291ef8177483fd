"""pytest plugin concern: label the target's measured lines with the test that ran them.

When the run measures the target (``rerun-test --coverage``), each test's phases run under the dynamic
context of its node id, so a line executed during a test is attributed to it. Not pytest-cov's
``--cov-context=test``, because pytest-cov also owns starting and combining the data, which here spans
servers, Ray workers and several groups. Detail: docs/modules.md.
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
