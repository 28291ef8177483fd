"""pytest plugin concern: the sglang under test (``--sglang TARGET``, env ``HARNESS_SGLANG``, ini
``harness_sglang``; the option wins, then the env var, then the ini key, then ``installed``).

Resolved in ``pytest_load_initial_conftests``, before anything imports sglang, so every process imports the
same tree; named in the report header and the JUnit XML. Detail: docs/modules.md.
"""

from __future__ import annotations

import os

import pytest

from harness.targets.sglang import selection as target_mod

target_key = pytest.StashKey[target_mod.Target]()


def _spec(config: pytest.Config) -> str | None:
    given = getattr(config.known_args_namespace, "sglang", None) or config.getoption("sglang", None)
    return given or os.environ.get(target_mod.ENV_VAR) or config.getini("harness_sglang") or None


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config: pytest.Config) -> None:
    # Initial conftests (suites/unit/conftest.py) import the adapter: the target goes first.
    from harness.targets.sglang.compat import checks

    try:
        early_config.stash[target_key] = target_mod.select(_spec(early_config))
        checks.selected()
    except (target_mod.TargetError, checks.UnknownCheck) as exc:
        raise pytest.UsageError(str(exc)) from None


def target(config: pytest.Config) -> target_mod.Target:
    """The session's sglang target.

    Args:
        config: the session's config.

    Returns:
        The :class:`~harness.targets.sglang.selection.Target` selected at start-up.
    """
    if target_key not in config.stash:  # a config built without the initial-conftest hook (pytester inline)
        config.stash[target_key] = target_mod.select(_spec(config))
    return config.stash[target_key]


def pytest_report_header(config: pytest.Config) -> list[str]:
    from pathlib import Path

    from harness.targets.sglang.compat import checks

    t = target(config)
    return [f"harness: {t.label()}, root {t.root}", checks.summary(Path(t.root))]


@pytest.fixture(scope="session", autouse=True)
def _sglang_junit_properties(request: pytest.FixtureRequest, record_testsuite_property) -> None:
    """Name the target in the JUnit XML (``<property name="sglang_version" …>``)."""
    from pathlib import Path

    from harness.targets.sglang.compat import checks

    t = target(request.config)
    for name, value in t.properties().items():
        record_testsuite_property(name, value)
    record_testsuite_property("sglang_checks", checks.summary(Path(t.root)))
