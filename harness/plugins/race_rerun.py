"""A test that a known upstream race hit by chance runs once more, so its own check still runs.

:mod:`harness.plugins.explain` reports such a test xfailed, with the race proven on the run's trace
(``KNOWN_RACES``: sglang's lost status update, which the stack watcher ends at once). That is true but
leaves the test's own assertion unchecked in that run: a test that sends its request to both servers at
the same moment meets the race in about one CI run of two. Here such a test runs again, once; the JUnit
report keeps the second attempt's outcome and names the first in a ``rerun_after_known_race`` property.
A second hit is reported xfailed as before. A test that forces a race on purpose (an ``xfail`` mark) is
never rerun.

Own code, not pytest-rerunfailures: that reruns failed tests by their error text, and a known race is
not a failure here (it is reported xfailed, with its evidence) by the time any rerun plugin would look.
"""

from __future__ import annotations

import pytest
from _pytest.runner import runtestprotocol

from harness.plugins.explain import known_race_key
from harness.plugins.record import new_attempt

#: Attempts of a test a known race hit (the first, and one more).
ATTEMPTS = 2
#: The JUnit property that names the first attempt's race.
PROPERTY = "rerun_after_known_race"


def _rerunnable(item: pytest.Item) -> bool:
    return item.get_closest_marker("xfail") is None and bool(item.stash.get(known_race_key, None))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> bool:
    """Run ``item``; when a known race hit it (and it does not force one), run it once more, and log only
    the last attempt's reports. It runs the test itself (as pytest's runner does), so a plugin that only
    watches a test's protocol must wrap it (``wrapper=True``): a plain implementation is never reached."""
    item.ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
    properties = list(item.user_properties)
    reports = runtestprotocol(item, nextitem=nextitem, log=False)
    for _ in range(ATTEMPTS - 1):
        if not _rerunnable(item):
            break
        first = next((r for r in reports if r.when == "call"), None)
        why = getattr(first, "wasxfail", "") or item.stash[known_race_key]
        del item.stash[known_race_key]
        item.user_properties[:] = [*properties, (PROPERTY, why[:2000])]
        new_attempt(item)
        reports = runtestprotocol(item, nextitem=nextitem, log=False)
    for report in reports:
        item.ihook.pytest_runtest_logreport(report=report)
    item.ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
    return True
