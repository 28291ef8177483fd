"""pytest plugin of the harness (installed through the ``pytest11`` entry point ``pd_harness``).

Markers:
    topology(*names): the topologies a test runs on (``topologies/NAME.toml``).
    est_time(seconds): estimated wall time, used by rerun-test to plan and shard.
"""

from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "topology(*names): topologies this test runs on (topologies/NAME.toml)")
    config.addinivalue_line("markers", "est_time(seconds): estimated wall time for planning and sharding")
