"""A target that travels: a source tree or wheel the driver selected, carried to the nodes of a joined
cluster by Ray's runtime environment (``py_modules``) instead of being looked for at the driver's path.

A tree or wheel is a path on the driver's disk, so it :func:`travels`; :func:`arrived` turns it back into a
:class:`Target` on the node; :func:`imported_root` says which tree ``import sglang`` gives, for the skew
check. How the copy is made and found, and why fork servers never meet it: docs/modules.md.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Callable

from harness.targets.sglang.resolve import ENV_VAR, Target, TargetError, release_deps_dir

#: Env var (set for every task and actor of a job the target travels with): the travelling target's
#: description (:meth:`Target.to_dict` as JSON), as the driver resolved it.
CARRIED_ENV = "HARNESS_SGLANG_CARRIED"
#: Origins whose TARGET is a path on the driver's disk.
TRAVELLING = ("tree", "wheel")


def travels(target: Target) -> bool:
    """Whether ``target`` is carried to a joined cluster's nodes (a tree or a wheel; see the module docstring)."""
    return target.origin in TRAVELLING


def package(target: Target) -> Path:
    """The directory Ray uploads for ``target``: its ``sglang/`` package (unpacked as ``sglang/`` on each node)."""
    return Path(target.root) / "sglang"


def environment(target: Target) -> dict[str, str]:
    """The environment that tells a node which TARGET arrived: ``HARNESS_SGLANG`` and :data:`CARRIED_ENV`."""
    return {ENV_VAR: target.spec, CARRIED_ENV: json.dumps(target.to_dict(), sort_keys=True)}


def arrived(spec: str, say: Callable[[str], None] | None = None) -> Target | None:
    """The target ``spec`` as it arrived on this node, or None when ``spec`` is not the travelling one.

    Args:
        spec: the TARGET this process was asked to run (``HARNESS_SGLANG``).
        say: where install progress goes (a release's pinned dependencies installed on this node).

    Returns:
        A :class:`Target` whose root is the shipped copy (its ``spec`` that copy's local path, so a
        process started from here resolves it as a tree), or None: nothing travels with this job,
        or it is another TARGET.

    Raises:
        TargetError: the job says ``spec`` travelled, but no copy of it is on this process's ``PYTHONPATH``.
    """
    raw = os.environ.get(CARRIED_ENV)
    if not raw:
        return None
    try:
        carried = Target.from_dict(json.loads(raw))
    except (json.JSONDecodeError, TypeError):
        raise TargetError(
            f"{CARRIED_ENV} is not a target description ({raw[:80]!r}); it is set by the harness "
            "for a joined cluster's workers, unset it"
        ) from None
    if carried.spec != spec:
        return None
    root = _shipped_root()
    if root is None:
        raise TargetError(
            f"{carried.label()} was shipped with this job but no copy of it is on this node's "
            "PYTHONPATH (Ray's py_modules); see the node's runtime_env_setup log"
        )
    return Target(
        spec=str(root),
        origin=carried.origin,
        version=carried.version,
        root=str(root),
        deps=release_deps_dir(carried.version, say),
        commit=carried.commit,
        dirty=carried.dirty,
    )


def _shipped_root() -> Path | None:
    """The first ``PYTHONPATH`` entry that holds ``sglang/``: Ray puts the job's ``py_modules`` first."""
    for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep):
        if entry and (Path(entry) / "sglang" / "__init__.py").is_file():
            return Path(entry)
    return None


def imported_root() -> Path | None:
    """The directory holding the ``sglang/`` that ``import sglang`` gives this process (the one already
    imported, else the one the import system would find), without importing it; None: none.

    Where the import system sees it: a tree of links to another tree's files is that tree, not the
    one its links resolve to (only the directory holding ``sglang/`` is resolved)."""
    loaded = sys.modules.get("sglang")
    location = getattr(loaded, "__file__", None) if loaded is not None else None
    if location is None:
        spec = importlib.util.find_spec("sglang")
        if spec is None or not spec.submodule_search_locations:
            return None
        location = os.path.join(list(spec.submodule_search_locations)[0], "__init__.py")
    return Path(os.path.abspath(location)).parent.parent.resolve()
