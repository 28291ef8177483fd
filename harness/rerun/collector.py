"""Collect the registry: every suite file under ``suites/`` and the ``--suites-dir`` trees.

Files under ``suites/`` are pytest suites (markers). In an external tree a file is taken when it
registers upstream-style (``register_cpu_ci``/``register_cuda_ci``) or carries a ``topology``
marker; anything else there is not ours to run. Measured durations replace estimates.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from harness.rerun import registry, upstream
from harness.rerun.registry import RegistryError, SuiteFile

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Root:
    """One tree of suite files. ``prefix`` starts every display path (``suites``, ``registered``)."""

    path: Path
    prefix: str
    external: bool = False


@dataclass(frozen=True)
class Registry:
    """All known suite files, in a stable order."""

    repo_root: Path
    roots: tuple[Root, ...]
    files: tuple[SuiteFile, ...]

    def by_rel(self, rel: str) -> SuiteFile | None:
        return next((f for f in self.files if f.rel == rel), None)

    def by_path(self, path: Path) -> SuiteFile | None:
        rp = path.resolve()
        return next((f for f in self.files if f.path.resolve() == rp), None)

    def by_name(self, name: str) -> list[SuiteFile]:
        return [f for f in self.files if f.name == name]


def make_roots(repo_root: Path, suites_dirs: list[Path]) -> tuple[Root, ...]:
    """The primary ``suites/`` root plus each external dir with a unique prefix.

    Raises:
        RegistryError: an external dir does not exist.
    """
    roots = [Root(repo_root / "suites", "suites")]
    used = {"suites"}
    for d in suites_dirs:
        d = d.resolve()
        if not d.is_dir():
            raise RegistryError(f"--suites-dir {d.name!r} is not a directory; pass an existing test tree")
        prefix = d.name
        if prefix in used:  # two trees with the same name: disambiguate with the parent
            prefix = f"{d.parent.name}-{d.name}"
        used.add(prefix)
        roots.append(Root(d, prefix, external=True))
    return tuple(roots)


def collect(
    repo_root: Path,
    suites_dirs: list[Path] | None = None,
    durations_files: list[Path] | None = None,
    mapping: upstream.UpstreamMap | None = None,
) -> Registry:
    """Build the registry.

    Args:
        repo_root: the repository (its ``suites/``, ``runs/*/report/durations.json`` and ``suites/durations.json``).
        suites_dirs: external trees (``--suites-dir``).
        durations_files: extra duration files, applied after the repository's and the latest run's.
        mapping: the upstream topology map (default: ``topologies/_upstream-map.toml``), loaded only
            when an external tree is given.

    Returns:
        The :class:`Registry`.

    Raises:
        RegistryError: a missing external tree, a bad durations or map file. Unreadable suite files
            are recorded in :attr:`SuiteFile.error` and raised when selected.
    """
    roots = make_roots(repo_root, list(suites_dirs or []))
    if any(r.external for r in roots) and mapping is None:
        mapping = upstream.load_map()
    files: list[SuiteFile] = []
    for root in roots:
        if not root.path.is_dir():
            continue
        for path, rel in registry.discover(root.path, root.prefix):
            # A broken file is recorded, not raised: it fails when selected, not every other rerun.
            sf = upstream.read_upstream(path, rel, mapping) if root.external else None
            if sf is None:
                try:
                    sf = registry.read_suite(path, rel, require_marker=root.external)
                except RegistryError as e:
                    sf = SuiteFile(path=path, rel=rel, tests=(), error=str(e))
            if sf is not None:
                files.append(sf)
    duration_sources = [repo_root / "suites" / registry.DURATIONS_FILE]
    past_runs = registry.recent_run_durations(repo_root / "runs")
    duration_sources += past_runs
    duration_sources += list(durations_files or [])
    durations = registry.load_durations(duration_sources, tolerant=past_runs)
    if durations:
        files = [registry.apply_durations(f, durations) for f in files]
    log.debug("registry: %d files from %d roots, %d measured durations", len(files), len(roots), len(durations))
    return Registry(repo_root=repo_root, roots=roots, files=tuple(files))
