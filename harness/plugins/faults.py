"""pytest plugin concern: inject named faults from the catalog (``harness/faults``) into the engine.

``--inject-fault NAME`` (repeatable) applies a fault for the whole session, in this process and every
process the tests start that runs engine code, and undoes it at the end; active faults are printed in the
report header. A bad name or patch is a usage error before any test. How and where it applies, and the
failure modes: docs/modules.md.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
from pathlib import Path
from typing import Iterator

import pytest

from harness import faults
from harness.faults import source
from harness.targets.sglang import selection as target_mod

log = logging.getLogger(__name__)

#: The session's injected fault names, and the ``HARNESS_FAULTS`` value before the session.
injected_key = pytest.StashKey[list[str]]()
previous_env_key = pytest.StashKey["dict[str, str | None]"]()
scratch_key = pytest.StashKey["Path | None"]()
_SAVED = (faults.ENV_VAR, "PYTHONPATH", source.FIRED_ENV, target_mod.OVERLAY_ENV)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("pd-harness")
    group.addoption(
        "--inject-fault",
        action="append",
        default=[],
        metavar="NAME",
        dest="inject_fault",
        help="apply this named fault (harness/faults catalog) to the engine for the session; repeatable",
    )
    group.addoption(
        "--stop-at-catch",
        action="store_true",
        default=False,
        help="with --inject-fault: stop the session after the first test whose body fails showing an injected "
        "fault's evidence (the fault check's runs: one catch decides the fault, the rest only cost time)",
    )


def pytest_configure(config: pytest.Config) -> None:
    requested = config.getoption("inject_fault", default=[]) or []
    try:
        names = faults.parse_names(",".join(requested))
    except faults.FaultError as exc:
        raise pytest.UsageError(f"--inject-fault: {exc}") from None
    config.stash[injected_key] = names
    config.stash[previous_env_key] = {k: os.environ.get(k) for k in _SAVED}
    config.stash[scratch_key] = None
    if not names:
        try:
            faults.activate_from_env()  # the caller's HARNESS_FAULTS (its patched copy is already first)
        except faults.FaultError as exc:
            raise pytest.UsageError(f"{faults.ENV_VAR}: {exc}") from None
        return
    merged = faults.parse_names(",".join([os.environ.get(faults.ENV_VAR, ""), *names]))
    patches = [n for n in merged if faults.get(n).is_patch]
    if patches:
        config.stash[scratch_key] = _put_patched_copy_first(patches)
    os.environ[faults.ENV_VAR] = ",".join(merged)
    faults.activate(merged)
    log.warning("faults injected for this session: %s", ", ".join(names))


def _put_patched_copy_first(patches: list[str]) -> Path:
    """Build the scratch sglang with ``patches`` and put it first on the import path of this process
    and (through ``PYTHONPATH``) of every process it starts."""
    if "sglang" in sys.modules:
        raise pytest.UsageError(
            f"--inject-fault {', '.join(patches)}: sglang is already imported in this process, "
            "so a patched copy cannot take its place; pass --inject-fault on the command line"
        )
    try:
        return source.put_patched_copy_first(
            patches,
            target_mod.sglang_root().resolve(),
            prefix="harness-fault-",
            overlay_env=target_mod.OVERLAY_ENV,  # a child re-activating the target keeps it first
            children=True,
        )
    except source.PatchError as exc:
        raise pytest.UsageError(f"--inject-fault: {exc}; the patch does not apply to this sglang") from None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[pytest.TestReport]:
    report = yield
    if report.when == "call" and report.failed and item.config.getoption("stop_at_catch", default=False):
        names = item.config.stash.get(injected_key, [])
        text = report.longreprtext
        caught = [n for n in names if any(e in text for e in faults.get(n).evidence)]
        if caught:
            # Checked between tests: this one still ends with its teardown (its fixtures stop their servers).
            item.session.shouldstop = f"{faults.STOP_AT_CATCH_LINE}{', '.join(caught)} caught by {item.nodeid}"
    return report


def pytest_unconfigure(config: pytest.Config) -> None:
    names = config.stash.get(injected_key, [])
    if not names:
        return
    faults.deactivate(names)
    for key, value in config.stash.get(previous_env_key, {}).items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    scratch = config.stash.get(scratch_key, None)
    if scratch is not None:
        if str(scratch) in sys.path:
            sys.path.remove(str(scratch))
        shutil.rmtree(scratch, ignore_errors=True)


def pytest_report_header(config: pytest.Config) -> str:
    names = faults.parse_names(os.environ.get(faults.ENV_VAR))
    if not names:
        return "faults: none"
    known = faults.catalog()
    return "faults: " + "; ".join(f"{name} ({known[name].upstream})" for name in names)
