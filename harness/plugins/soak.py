"""pytest plugin concern: how long a soak runs.

Option (group ``pd-harness``):
    --soak N        requests the soak suites push through their PD pair (default
                    :data:`DEFAULT_REQUESTS`, what ``./dev test`` runs; ``bench/soak.py`` runs 10,000)

Fixture:
    soak_requests   N
"""

from __future__ import annotations

import pytest

#: Requests of a soak when ``--soak`` is not given.
DEFAULT_REQUESTS = 300

soak_key = pytest.StashKey[int]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("pd-harness")
    group.addoption("--soak", type=int, default=None, metavar="N",
                    help=f"requests the soak suites push through their PD pair (default {DEFAULT_REQUESTS})")


def pytest_configure(config: pytest.Config) -> None:
    n = config.getoption("soak", default=None)
    if n is not None and n < 1:
        raise pytest.UsageError(f"--soak {n}: a soak needs at least 1 request; give a positive number")
    config.stash[soak_key] = DEFAULT_REQUESTS if n is None else n


@pytest.fixture
def soak_requests(request: pytest.FixtureRequest) -> int:
    """Requests the soak pushes through its pair (``--soak N``)."""
    return request.config.stash[soak_key]
