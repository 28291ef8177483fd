"""What travels with a run to a cluster the harness joined, and the one connection that carries it.

A joined cluster's nodes are other machines: a path on the driver's disk means nothing there. So
every connection to a joined cluster (:func:`harness.cluster.join.connect`, which
:meth:`harness.cluster.Cluster.join` and the commands' preflight use) gives the job the Ray runtime
environment :func:`runtime_env`, which carries to every task and actor of the job on every node:

* the harness itself (its package directory), for nodes that lack it: a worker actor's class and
  its payloads are imported from the copy Ray unpacked, which is the driver's code;
* the sglang target when it is a source tree or a wheel (:mod:`harness.targets.sglang.travel`): its
  ``sglang/`` package and its description, from which the node's worker selects the copy.

Ray uploads each package once per content (``py_modules``: hashed, zipped, stored in the GCS;
``__pycache__`` and ``*.pyc`` left out), unpacks it under each node's
``<session>/runtime_resources/py_modules_files/`` and puts it first on the worker's ``PYTHONPATH``.
The survey that follows the connection (:func:`harness.cluster.nodes.survey`) runs in the same job,
so the version-skew check compares what each node will import: the copies, not the node's own
install. The limit is Ray's (``RAY_max_grpc_message_size``, 512 MiB per package).

A cluster the harness started (local or simulated) is never connected through here: it runs on
this machine, where the target's path is, and nothing is uploaded.

A command a worker starts (a real sglang server) gets the ``PYTHONPATH`` built on the driver in front
of the worker's own (:class:`harness.workers.Subprocess`), so it imports the copies too.

Not carried: the repository around the harness (``suites/``, ``topologies/``): pytest inside a
worker (:mod:`harness.workers.suiterun`) still runs the node's checkout at the driver's repository
path (``HARNESS_REPO_ROOT``, set here for the job); and a real server's ``sitecustomize`` directory,
named by its path on the driver (:mod:`harness.engines.server.launcher`).
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
