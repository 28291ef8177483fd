"""pytest plugin concern: inject named faults from the catalog (``harness/faults``) into the engine.

Option (group ``pd-harness``):
    --inject-fault NAME   apply fault NAME for the whole session (repeatable). Known names and what
                          they break: ``harness faults`` / ``harness.faults.catalog()``.

How: the names are added to env ``HARNESS_FAULTS`` for the session, so the sglang adapter applies
them when it is imported here, and every process the tests start (Ray workers, server
subprocesses) inherits them; if the adapter is already imported they are applied at once. At the
end of the session the faults are undone and the variable restored. Active faults are printed in
the report header, so a failing run says it was deliberately broken.

Failure modes: an unknown name is a usage error naming the known ones (exit 4, before any test).
"""

from __future__ import annotations

import logging
import os
import sys

import pytest

from harness import faults

log = logging.getLogger(__name__)

#: The session's injected fault names, and the ``HARNESS_FAULTS`` value before the session.
injected_key = pytest.StashKey[list[str]]()
previous_env_key = pytest.StashKey["str | None"]()

_ADAPTER = "harness.targets.sglang"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("pd-harness")
    group.addoption("--inject-fault", action="append", default=[], metavar="NAME", dest="inject_fault",
                    help="apply this named fault (harness/faults catalog) to the engine for the session; "
                         "repeatable")


def pytest_configure(config: pytest.Config) -> None:
    requested = config.getoption("inject_fault", default=[]) or []
    try:
        names = faults.parse_names(",".join(requested))
    except faults.FaultError as exc:
        raise pytest.UsageError(f"--inject-fault: {exc}") from None
    config.stash[injected_key] = names
    config.stash[previous_env_key] = os.environ.get(faults.ENV_VAR)
    if not names:
        return
    merged = faults.parse_names(",".join([os.environ.get(faults.ENV_VAR, ""), *names]))
    os.environ[faults.ENV_VAR] = ",".join(merged)
    if _ADAPTER in sys.modules:  # already imported (and so past its own activation): apply now
        faults.activate(merged)
    log.warning("faults injected for this session: %s", ", ".join(names))


def pytest_unconfigure(config: pytest.Config) -> None:
    names = config.stash.get(injected_key, [])
    if not names:
        return
    faults.deactivate(names)
    previous = config.stash.get(previous_env_key, None)
    if previous is None:
        os.environ.pop(faults.ENV_VAR, None)
    else:
        os.environ[faults.ENV_VAR] = previous


def pytest_report_header(config: pytest.Config) -> str:
    names = faults.parse_names(os.environ.get(faults.ENV_VAR))
    if not names:
        return "faults: none"
    known = faults.catalog()
    return "faults: " + "; ".join(f"{name} ({known[name].upstream})" for name in names)
