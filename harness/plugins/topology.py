"""pytest plugin concern: which topology a test runs on (markers, parametrization, the ``topology`` fixture).

Markers ``topology(*names)`` and ``est_time(seconds)``; fixture ``topology``. Collection records the
topologies the selected tests name, so a simulated cluster gets enough nodes. Detail: docs/modules.md.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from harness import topology as topology_mod
from harness.plugins.options import settings
from harness.plugins.state import state


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "topology(*names): topologies this test runs on (topologies/NAME.toml)")
    config.addinivalue_line("markers", "est_time(seconds): estimated wall time for planning and sharding")


def _marker_names(item_or_def: Any) -> tuple[str, ...]:
    m = item_or_def.get_closest_marker("topology") if hasattr(item_or_def, "get_closest_marker") else None
    return tuple(str(a) for a in m.args) if m is not None else ()


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "topology" not in metafunc.fixturenames:
        return
    m = metafunc.definition.get_closest_marker("topology")
    if m is None or len(m.args) < 2 or settings(metafunc.config).topology:
        return
    metafunc.parametrize("topology", list(m.args), indirect=True, ids=[str(a) for a in m.args])


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    st = state(config)
    for item in items:
        st.topologies.update(_marker_names(item))
    if st.settings.topology:
        st.topologies.add(st.settings.topology)


def _pick_topology(request: pytest.FixtureRequest) -> str:
    s = settings(request.config)
    names = _marker_names(request.node)
    param = getattr(request, "param", None)
    if param is not None:
        return str(param)
    m = request.node.get_closest_marker("topology")
    if m is not None and not names:
        pytest.fail(f'{request.node.nodeid}: @pytest.mark.topology() needs a name, e.g. topology("cpu")', pytrace=False)
    if s.topology:
        if names and s.topology not in names and Path(s.topology).stem not in names:
            pytest.skip(f"runs on {', '.join(names)}; --topology is {s.topology}")
        return s.topology
    return names[0] if names else "cpu"


@pytest.fixture
def topology(request: pytest.FixtureRequest) -> topology_mod.Topology:
    """The test's topology: its marker (or the parametrized one), ``--topology``, else ``cpu``."""
    name = _pick_topology(request)
    try:
        return topology_mod.get(name)
    except topology_mod.TopologyError as e:
        pytest.fail(f"{request.node.nodeid}: {e}", pytrace=False)
