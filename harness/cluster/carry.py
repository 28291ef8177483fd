"""What travels with a run to a cluster the harness joined, and the one connection that carries it.

A joined cluster's nodes are other machines, where a path on the driver's disk means nothing. So every
connection to a joined cluster gives the job the runtime environment :func:`runtime_env`: the harness
package and a tree or wheel sglang target, uploaded by Ray as ``py_modules`` and put first on every
worker's ``PYTHONPATH``. A cluster the harness started uploads nothing. What is and is not carried, and
Ray's limits: docs/modules.md.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from harness.rundir import REPO_ROOT, REPO_ROOT_ENV
from harness.targets.sglang import travel
from harness.targets.sglang.selection import Target

#: The harness package directory (``harness/``), carried as one ``py_modules`` entry.
HARNESS_DIR = Path(__file__).resolve().parents[1]
#: Left out of every carried package (gitignore patterns, relative to the package).
EXCLUDES = ("__pycache__/", "*.pyc", "*.pyo")


def runtime_env(target: Target) -> dict[str, Any]:
    """The job's Ray runtime environment on a joined cluster (see the module docstring).

    Args:
        target: the run's sglang target.

    Returns:
        ``{"py_modules": [...], "excludes": [...], "env_vars": {...}}``: the harness, and the
        target's package and description when it travels.
    """
    modules = [str(HARNESS_DIR)]
    env_vars = {REPO_ROOT_ENV: str(REPO_ROOT)}
    if travel.travels(target):
        modules.append(str(travel.package(target)))
        env_vars.update(travel.environment(target))
    return {"py_modules": modules, "excludes": list(EXCLUDES), "env_vars": env_vars}
