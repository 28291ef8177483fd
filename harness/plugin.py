"""pytest plugin of the harness (installed through the ``pytest11`` entry point ``pd_harness``).

This module is only the entry point: each concern is a plugin module of its own under ``harness/plugins/``,
registered through :data:`pytest_plugins` below (its docstring says what it adds). Order matters:
``options`` first (it creates the option group the others add to), then the core concerns, so their hooks
keep their place. What each plugin adds, and why the order: docs/modules.md.
"""

from __future__ import annotations

#: Concern plugins (``harness/plugins/<concern>.py``) loaded with this one: add one line each.
pytest_plugins: list[str] = [
    "harness.plugins.options",
    "harness.plugins.target",
    "harness.plugins.state",
    "harness.plugins.failfast",
    "harness.plugins.explain",
    "harness.plugins.race_rerun",
    "harness.plugins.explicit",
    "harness.plugins.topology",
    "harness.plugins.cluster",
    "harness.plugins.engine",
    "harness.plugins.servers",
    "harness.plugins.stackwatch",
    "harness.plugins.pd",
    "harness.plugins.seeds",
    "harness.plugins.soak",
    "harness.plugins.faults",
    "harness.plugins.record",
    "harness.plugins.parallel",
    "harness.plugins.coverage",
]
