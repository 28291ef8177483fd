"""pytest plugin concern: how long a soak runs.

``--soak N`` and the fixtures ``soak_requests`` and ``server_soak_requests`` (defaults
:data:`DEFAULT_REQUESTS` and :data:`DEFAULT_SERVER_REQUESTS`). Detail: docs/modules.md.
"""

from __future__ import annotations

import pytest

#: Requests of a soak of the simulated engine when ``--soak`` is not given.
DEFAULT_REQUESTS = 300
#: Requests of a soak of a real CPU stack when ``--soak`` is not given (a few seconds of requests: CI
#: runs it on the session's stack; ``--soak 2000`` or ``bench/soak.py --engine server`` for the long one).
DEFAULT_SERVER_REQUESTS = 50

soak_key = pytest.StashKey[int | None]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("pd-harness")
    group.addoption(
        "--soak",
        type=int,
        default=None,
        metavar="N",
        help=f"requests the soak suites push through their PD pair (default {DEFAULT_REQUESTS} simulated, "
        f"{DEFAULT_SERVER_REQUESTS} on a real CPU stack)",
    )


def pytest_configure(config: pytest.Config) -> None:
    n = config.getoption("soak", default=None)
    if n is not None and n < 1:
        raise pytest.UsageError(f"--soak {n}: a soak needs at least 1 request; give a positive number")
    config.stash[soak_key] = n


@pytest.fixture
def soak_requests(request: pytest.FixtureRequest) -> int:
    """Requests the soak pushes through its simulated pair (``--soak N``, default :data:`DEFAULT_REQUESTS`)."""
    n = request.config.stash[soak_key]
    return DEFAULT_REQUESTS if n is None else n


@pytest.fixture
def server_soak_requests(request: pytest.FixtureRequest) -> int:
    """Requests the soak pushes through a real stack (``--soak N``, default :data:`DEFAULT_SERVER_REQUESTS`)."""
    n = request.config.stash[soak_key]
    return DEFAULT_SERVER_REQUESTS if n is None else n
