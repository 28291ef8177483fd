"""Which sglang this process and every process it starts runs: the selected :class:`Target`
(resolved by :mod:`.resolve`) made the one every process imports.

:func:`activate` puts the target first on the import path and records it in ``HARNESS_SGLANG``, so every
process imports the same tree; :func:`current` is the target this process runs; :func:`stamp` is how a
report names it. A bad TARGET raises :class:`TargetError`. Detail: docs/modules.md.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import logging
import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from harness.report import stamp as report_stamp
from harness.targets.sglang import releases, travel
from harness.targets.sglang.resolve import (  # the selection's vocabulary, re-exported
    CACHE_ENV,
    ENV_VAR,
    INSTALLED,
    Target,
    TargetError,
    cache_dir,
    resolve,
)

if TYPE_CHECKING:
    from harness.workers import WorkerSpec

logger = logging.getLogger(__name__)

#: A directory holding a modified copy of the target's ``sglang/`` (a fault's scratch copy,
#: :mod:`harness.plugins.faults`): it stays ahead of the target on every import path, so a child
#: process that re-activates the target still imports the copy.
OVERLAY_ENV = "HARNESS_SGLANG_OVERLAY"
#: Help text shared by every entry point's ``--sglang`` option.
HELP = (
    "the sglang under test: 'installed' (default), a release like 0.5.21 (installed on demand), "
    "a source tree (a checkout's python/ dir or any dir holding sglang/) or a wheel file; env HARNESS_SGLANG"
)

__all__ = [
    "CACHE_ENV",
    "ENV_VAR",
    "HELP",
    "INSTALLED",
    "OVERLAY_ENV",
    "WORKER_SETUP",
    "Target",
    "TargetError",
    "activate",
    "cache_dir",
    "current",
    "resolve",
    "select",
    "select_for_cli",
    "sglang_root",
    "stamp",
    "worker_spec",
]


def activate(target: Target) -> None:
    """Make ``target`` the sglang this process and every process it starts imports.

    Puts its directories first on ``sys.path`` and ``PYTHONPATH`` (after ``$HARNESS_SGLANG_OVERLAY``,
    a patched copy of it, when set), records its TARGET in
    ``HARNESS_SGLANG`` (a child re-resolves it from the cache, which is cheap) and sets the
    environment the release needs here (:func:`harness.targets.sglang.releases.process_env`). Idempotent.

    Args:
        target: the resolved target.

    Raises:
        TargetError: sglang was already imported in this process from another directory (the target
            must be activated before anything imports sglang).
    """
    os.environ[ENV_VAR] = target.spec
    for key, value in releases.process_env(Path(target.root)).items():
        os.environ.setdefault(key, value)  # inherited by every process this one starts
    overlay = os.environ.get(OVERLAY_ENV)
    loaded = sys.modules.get("sglang")
    if loaded is not None and target.origin != INSTALLED:
        # Where it was imported from as the import system saw it: a tree of links to another tree's
        # files (the tests' unpacked release) is that tree, not the one its links resolve to. The
        # overlay is the target's own patched copy (a fault or mutant run): a rank that preloaded
        # sglang from it imported the target.
        where = Path(os.path.abspath(getattr(loaded, "__file__", "") or "")).parent.parent
        if where.resolve() not in {Path(p).resolve() for p in (target.root, *([overlay] if overlay else []))}:
            raise TargetError(
                f"sglang was imported from {where} before the target {target.label()} was "
                "selected; pass --sglang (or HARNESS_SGLANG) before anything imports sglang"
            )
    front = [*([overlay] if overlay else []), *target.paths]
    if not front:
        return
    for path in reversed(front):
        if path in sys.path:
            sys.path.remove(path)
        sys.path.insert(0, path)
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p not in front]
    os.environ["PYTHONPATH"] = os.pathsep.join([*front, *inherited])
    importlib.invalidate_caches()


_current: dict[str, Target] = {}


def current() -> Target:
    """The target this process runs: ``$HARNESS_SGLANG`` resolved and activated once per process (on a
    joined cluster's node, a tree or wheel the driver shipped is the copy that arrived:
    :func:`harness.targets.sglang.travel.arrived`).

    Returns:
        The :class:`Target`.

    Raises:
        TargetError: the TARGET in the environment cannot be used.
    """
    spec = (os.environ.get(ENV_VAR) or INSTALLED).strip()
    if spec not in _current:
        # A tree or wheel the driver shipped to this node (a joined cluster's worker) is the copy that arrived.
        target = travel.arrived(spec) or resolve(spec)
        activate(target)
        _current[spec] = _current[target.spec] = target  # activate() names the copy by its local path
    return _current[spec]


def select(spec: str | None, *, progress: Callable[[str], None] | None = None) -> Target:
    """Resolve ``spec`` (None: the environment's TARGET, then ``installed``) and activate it; what every
    entry point calls with its ``--sglang`` value before it runs anything.

    Args:
        spec: the option's value.
        progress: where install progress lines go.

    Returns:
        The activated :class:`Target`.

    Raises:
        TargetError: the TARGET cannot be used.
    """
    target = resolve(spec, progress=progress)
    activate(target)
    _current[target.spec] = target
    return target


def select_for_cli(spec: str | None, prog: str) -> Target:
    """:func:`select` for a command-line entry point: install progress as ``PROG: …`` lines on stderr.

    Args:
        spec: the ``--sglang`` value (None: ``$HARNESS_SGLANG``, then ``installed``).
        prog: the command's name.

    Returns:
        The activated :class:`Target`.

    Raises:
        TargetError: the TARGET cannot be used (the caller prints it and exits 2).
    """
    return select(spec, progress=lambda line: print(f"{prog}: {line}", file=sys.stderr, flush=True))


def sglang_root(spec: str | None = None) -> Path:
    """The directory holding the target's ``sglang/`` package (what a source patch is applied to a copy of).

    Args:
        spec: a TARGET; None means the one this process runs (``$HARNESS_SGLANG`` or ``installed``).

    Returns:
        The directory that holds ``sglang/``.

    Raises:
        TargetError: the TARGET cannot be used.
    """
    return Path((current() if spec is None else resolve(spec)).root)


#: The setup a worker actor runs before its payload (``WorkerSpec.setup``): :func:`current` there.
WORKER_SETUP = f"{__name__}:current"


def worker_spec(spec: "WorkerSpec", target: Target | None = None) -> "WorkerSpec":
    """``spec`` for a worker that runs ``target``: its actor gets the TARGET in its environment and
    selects it first (:func:`current`, resolved on the actor's own node: a release from that node's
    cache, installed there on first use; on a joined cluster, a tree or wheel from the copy that arrived
    with the job, :mod:`.travel`), so its payload and any server it starts import that tree
    and get the environment the release needs (:func:`harness.targets.sglang.releases.process_env`).

    Args:
        spec: the worker's spec.
        target: the target (default: the one this process runs, :func:`current`).

    Returns:
        A copy of ``spec`` with the TARGET in ``env`` (the spec's own value wins) and
        :data:`WORKER_SETUP` in ``setup``.
    """
    target = current() if target is None else target
    setup = spec.setup if WORKER_SETUP in spec.setup else (WORKER_SETUP, *spec.setup)
    return replace(spec, env={ENV_VAR: target.spec, **spec.env}, setup=setup)


def stamp(target: Target | None = None, dist: str = "sglang") -> report_stamp.Target:
    """How a run's reports name the sglang it tested (:class:`harness.report.stamp.Target`).

    A release, a source tree (its git commit and dirty state) or a wheel is named by its version and
    root; the installed distribution by where it was installed from and, for a VCS or local install,
    its commit, from its metadata (PEP 610 ``direct_url.json``).

    Args:
        target: the run's target (default: the one this process runs, :func:`current`).
        dist: the distribution name (for the installed target).

    Returns:
        The stamp (``Target("not installed", "-")`` when no sglang can be found).
    """
    try:
        selected = current() if target is None else target
    except TargetError:
        return report_stamp.Target("not installed", "-")
    if selected.origin != INSTALLED:
        dirty = ", dirty" if selected.dirty else ""
        return report_stamp.Target(selected.version, f"{selected.origin} {selected.root}{dirty}", selected.commit or "")
    try:
        d = importlib.metadata.distribution(dist)
    except importlib.metadata.PackageNotFoundError:
        return report_stamp.Target("not installed", "-")
    origin, commit = "package index", ""
    raw = d.read_text("direct_url.json")
    if raw:
        try:
            info = json.loads(raw)
            origin = str(info.get("url") or origin)
            commit = str((info.get("vcs_info") or {}).get("commit_id") or "")
        except (json.JSONDecodeError, AttributeError):
            pass  # a broken PEP 610 file: the version alone still says what ran
    return report_stamp.Target(d.version, origin, commit)
