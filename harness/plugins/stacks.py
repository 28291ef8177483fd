"""The pytest session's real server stacks: a :class:`~harness.engines.server.stack_pool.StackPool` whose
callbacks are the session's (its fail-fast watchdog, its unique worker names, ``pytest.fail``). The fixtures
that hand them to tests are :mod:`harness.plugins.servers`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Mapping, NoReturn, Sequence

import pytest

from harness import topology as topology_mod
from harness.engines.server.stack_pool import StackPool
from harness.rundir import RunDir

if TYPE_CHECKING:
    from harness.cluster import Cluster


def _fail(message: str) -> NoReturn:
    pytest.fail(message, pytrace=False)


def session_stacks(
    config: pytest.Config,
    cluster: Cluster | None,
    topology: topology_mod.Topology,
    run_dir: RunDir | None,
    *,
    models: Mapping[str, Path] | None = None,
    server_args: Sequence[str] = (),
) -> StackPool:
    """The session's stacks on ``topology`` whose servers get ``server_args``: every worker handed out is
    watched by the session's fail-fast watchdog (and out of it before a stop or a kill on purpose), named
    uniquely in the run, and a model that cannot be resolved or a missing package fails the test."""
    from harness.plugins.state import state

    st = state(config)
    return StackPool(
        cluster,
        topology,
        run_dir,
        models=models,
        server_args=server_args,
        watch=st.watch,
        unwatch=st.unwatch,
        unique_name=st.unique_name,
        fail=_fail,
    )
