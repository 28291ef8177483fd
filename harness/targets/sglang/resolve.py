"""Resolving a ``--sglang TARGET`` to a :class:`Target`: the tree on disk it names, its version and
provenance, installing a release or wheel into the target cache once.

TARGET is ``installed`` (the default), a release (``0.5.21``), a directory used in place, or a wheel file.
A bad TARGET raises :class:`TargetError` with one line saying what to pass instead; entry points exit 2
before running anything. Each form, the cache and its install: docs/modules.md.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from harness.targets.sglang import releases
from harness.targets.sglang.version import read_version, release_tuple

logger = logging.getLogger(__name__)

#: Env var carrying the TARGET to every subprocess.
ENV_VAR = "HARNESS_SGLANG"
#: The default TARGET.
INSTALLED = "installed"
#: Env var overriding where releases and wheels are installed.
CACHE_ENV = "HARNESS_SGLANG_CACHE"
_PIP_TIMEOUT_S = 900
_RELEASE = re.compile(r"^\d+\.\d+\.\d+(?:[.\-+]?(?:rc|post|dev|a|b)\d*)?$")
#: What a release TARGET looks like (``0.5.22``, ``0.5.17.dev0``): the one pattern, for readers of recorded targets.
RELEASE = _RELEASE


class TargetError(ValueError):
    """A TARGET that cannot be used: one line naming what was wrong and what to pass instead."""


@dataclass(frozen=True)
class Target:
    """The sglang under test, resolved once.

    Attributes:
        spec: the TARGET as given (``installed``, ``0.5.21``, a path, a wheel).
        origin: ``installed``, ``release``, ``tree`` or ``wheel``.
        version: the tree's sglang version (``unknown`` when nothing records it).
        root: the directory that holds ``sglang/``.
        deps: more import directories placed after ``root`` (a release's pinned dependencies).
        commit: the git commit of a tree inside a git checkout (None otherwise).
        dirty: whether that checkout has uncommitted changes under ``root`` (None: not a checkout).
    """

    spec: str
    origin: str
    version: str
    root: str
    deps: tuple[str, ...] = ()
    commit: str | None = None
    dirty: bool | None = None

    @property
    def paths(self) -> tuple[str, ...]:
        """Directories to put first on the import path (none for ``installed``)."""
        return () if self.origin == INSTALLED else (self.root, *self.deps)

    def label(self) -> str:
        """One line for headers and tables, e.g. ``sglang 0.5.21 (release)`` or
        ``sglang 0.5.23 (tree /src/sglang/python @ 1a2b3c4d5e6f, dirty)``."""
        where = ""
        if self.origin in ("tree", "wheel"):
            where = f" {self.root if self.origin == 'tree' else Path(self.spec).name}"
        git = ""
        if self.commit:
            git = f" @ {self.commit[:12]}{', dirty' if self.dirty else ''}"
        return f"sglang {self.version} ({self.origin}{where}{git})"

    def to_dict(self) -> dict[str, object]:
        """JSON-able description (for result.json, repro bundles and the run's JSON report)."""
        data = asdict(self)
        data["deps"] = list(self.deps)
        return data

    def properties(self) -> dict[str, str]:
        """Flat string properties for JUnit ``<property>`` elements."""
        props = {
            "sglang_version": self.version,
            "sglang_origin": self.origin,
            "sglang_spec": self.spec,
            "sglang_root": self.root,
        }
        if self.commit:
            props.update(sglang_commit=self.commit, sglang_dirty=str(bool(self.dirty)).lower())
        return props

    @classmethod
    def from_dict(cls, data: dict) -> "Target":
        """The inverse of :meth:`to_dict`.

        Raises:
            TargetError: ``data`` is not a target description.
        """
        try:
            return cls(
                spec=str(data["spec"]),
                origin=str(data["origin"]),
                version=str(data["version"]),
                root=str(data["root"]),
                deps=tuple(data.get("deps") or ()),
                commit=data.get("commit"),
                dirty=data.get("dirty"),
            )
        except (KeyError, TypeError) as exc:
            raise TargetError(
                f"not a sglang target description ({exc!r}); expected the 'sglang' object of a "
                "result.json or repro.json"
            ) from None


def _default_progress(line: str) -> None:
    logger.warning("%s", line)


def resolve(spec: str | None = None, *, progress: Callable[[str], None] | None = None) -> Target:
    """Resolve a TARGET (installing a release or wheel into the cache when needed).

    Args:
        spec: the TARGET; None or "" means ``$HARNESS_SGLANG``, then ``installed``.
        progress: where one-line progress messages go (an install takes a minute); default: a log warning.

    Returns:
        The :class:`Target`.

    Raises:
        TargetError: an unknown release, a missing path, a directory without ``sglang/``, a file that is
            not a wheel, a release outside the supported range, or a tree lacking the core.
    """
    spec = (spec or os.environ.get(ENV_VAR) or INSTALLED).strip()
    say = progress or _default_progress
    if spec == INSTALLED:
        target = _installed()
    elif _RELEASE.match(spec):
        target = _release(spec, say)
    elif spec.endswith(".whl"):
        target = _wheel(spec, say)
    else:
        target = _tree(spec, say)
    missing = releases.core_missing(Path(target.root))
    if missing:
        raise TargetError(
            f"{target.label()} lacks the core the harness drives ({missing}); supported: "
            f"sglang {releases.SUPPORTED_RANGE} or a source tree of one"
        )
    return target


def _installed() -> Target:
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        raise TargetError(
            "no sglang is importable here; install one (./dev install) or pass --sglang 0.5.N | PATH | WHEEL"
        )
    root = Path(list(spec.submodule_search_locations)[0]).resolve().parent
    return Target(spec=INSTALLED, origin=INSTALLED, version=read_version(root), root=str(root))


def _tree(spec: str, say: Callable[[str], None]) -> Target:
    path = Path(spec).expanduser()
    if not path.exists():
        raise TargetError(
            f"sglang target {spec!r}: no such file or directory; pass a sglang checkout's python/ "
            "directory, a directory holding sglang/, a wheel or a release like 0.5.21"
        )
    if path.is_file():
        raise TargetError(
            f"sglang target {spec!r} is a file but not a wheel (*.whl); pass a wheel, a directory "
            "holding sglang/ or a release like 0.5.21"
        )
    path = path.resolve()
    for root in (path, path / "python"):
        if (root / "sglang" / "__init__.py").is_file():
            commit, dirty = _git_state(root)
            found = read_version(root)
            return Target(
                spec=spec,
                origin="tree",
                version=found,
                root=str(root),
                deps=_deps(found, say),
                commit=commit,
                dirty=dirty,
            )
    raise TargetError(
        f"sglang target {spec!r} holds no sglang/ package; pass a sglang checkout's python/ "
        "directory or a directory holding sglang/"
    )


def _git_state(root: Path) -> tuple[str | None, bool | None]:
    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(
                ["git", "-C", str(root), *args], capture_output=True, text=True, timeout=30, check=False
            )
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout if done.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    if commit is None:
        return None, None
    status = git("status", "--porcelain", "--untracked-files=no", "--", ".")
    return commit.strip(), bool(status and status.strip())


def _release(version: str, say: Callable[[str], None]) -> Target:
    refusal = releases.release_refused(version)
    if refusal:
        raise TargetError(refusal)
    root = cache_dir() / version
    if not (root / ".complete").is_file():
        _on_index(version, say)  # before anything is written: a refused release leaves nothing behind
    install_once(
        root,
        [f"sglang=={version}"],
        f"sglang {version}",
        say,
        missing=f"sglang {version} is not on the package index; pass a released version "
        f"({releases.SUPPORTED_RANGE}), a source tree or a wheel",
    )
    found = read_version(root)
    return Target(spec=version, origin="release", version=found, root=str(root), deps=_deps(found, say))


def index_versions(package: str = "sglang") -> tuple[str, ...] | None:
    """The releases of ``package`` on the package index pip is configured with (``pip index versions``:
    the same index, mirrors and ``PIP_*`` settings an install would use), newest first; None when
    the index cannot be asked (offline, an old pip): the install then says what went wrong."""
    cmd = [sys.executable, "-m", "pip", "index", "versions", package, "--disable-pip-version-check"]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=_PIP_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0:
        return () if "No matching distribution" in (done.stderr or "") else None
    for line in done.stdout.splitlines():
        if line.startswith("Available versions:"):
            return tuple(v.strip() for v in line.split(":", 1)[1].split(",") if v.strip())
    return None


def _on_index(version: str, say: Callable[[str], None]) -> None:
    """Refuse a release the package index does not have (one line naming the newest it has); warn
    about one newer than the newest the harness was checked against."""
    available = index_versions("sglang")
    if available is not None and version not in available:
        newest = next((v for v in available if release_tuple(v)), "none")
        raise TargetError(
            f"sglang {version} is not on the package index (its newest release is {newest}); "
            f"pass a released version ({releases.SUPPORTED_RANGE}), a source tree or a wheel"
        )
    parsed = release_tuple(version)
    if parsed and parsed[:3] > releases.NEWEST_CHECKED:
        newest_checked = ".".join(map(str, releases.NEWEST_CHECKED))
        say(
            f"warning: sglang {version} is newer than the newest release the harness was checked against "
            f"({newest_checked}); trying it: a capability it lacks is said when a test needs it"
        )


def _wheel(spec: str, say: Callable[[str], None]) -> Target:
    wheel = Path(spec).expanduser()
    if not wheel.is_file():
        raise TargetError(
            f"sglang target {spec!r}: no such wheel file; pass an existing *.whl, a source tree "
            "or a release like 0.5.21"
        )
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()[:16]
    root = cache_dir() / f"wheel-{digest}"
    install_once(
        root,
        [str(wheel.resolve())],
        f"sglang wheel {wheel.name}",
        say,
        missing=f"sglang target {spec!r} could not be installed; pass a valid sglang wheel",
    )
    if not (root / "sglang" / "__init__.py").is_file():
        raise TargetError(f"sglang target {spec!r} holds no sglang/ package; pass a sglang wheel")
    found = read_version(root)
    return Target(spec=spec, origin="wheel", version=found, root=str(root), deps=_deps(found, say))


def release_deps_dir(version: str, say: Callable[[str], None] | None = None) -> tuple[str, ...]:
    """The import directories of the module-level dependencies sglang ``version`` pins where the venv's
    differ (installed once into ``<cache>/deps-<release>``); empty when the venv's serve it.

    Raises:
        TargetError: they could not be installed.
    """
    return _deps(version, say or _default_progress)


def _deps(version: str, say: Callable[[str], None]) -> tuple[str, ...]:
    """The import directory of a release's pinned module-level dependencies (installed once per
    release into ``<cache>/deps-<release>``), or nothing when the venv's serve it."""
    parsed = release_tuple(version)
    release = ".".join(map(str, parsed)) if parsed else version
    reqs = releases.release_deps(release)
    if not reqs:
        return ()
    into = cache_dir() / f"deps-{release}"
    install_once(
        into,
        list(reqs),
        f"sglang {release}'s pinned dependencies",
        say,
        missing=f"sglang {release}'s pinned dependencies {' '.join(reqs)} could not be installed",
    )
    return (str(into),)


def cache_dir() -> Path:
    """Where releases and wheels are installed: ``$HARNESS_SGLANG_CACHE`` or ``<sys.prefix>/sglang-targets``
    (inside the virtual environment, so a fresh clone's ``.venv`` owns it)."""
    return Path(os.environ.get(CACHE_ENV) or Path(sys.prefix) / "sglang-targets")


def install_once(dest: Path, reqs: list[str], what: str, say: Callable[[str], None], *, missing: str) -> None:
    """``pip install --no-deps --target dest REQS`` once; a ``.complete`` marker written last makes a
    half-finished install invisible, and a lock makes a parallel run wait for it, then reuse it.

    Raises:
        TargetError: pip failed or timed out (``missing`` says what, pip's last error line why).
    """
    marker = dest / ".complete"
    if marker.is_file():
        return
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(dest.parent / f".{dest.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if marker.is_file():
            return
        shutil.rmtree(dest, ignore_errors=True)
        say(f"{what}: installing into {dest} (once; reused by later runs)")
        try:
            pip_install(reqs, dest, missing)
        except TargetError:
            Path(lock.name).unlink(missing_ok=True)  # a failed install leaves nothing of itself
            raise
        marker.write_text(json.dumps({"installed": reqs}) + "\n")


def pip_install(reqs: list[str], into: Path, missing: str) -> None:
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--no-deps",
        "--no-compile",
        "--disable-pip-version-check",
        "-q",
        "--target",
        str(into),
        *reqs,
    ]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=_PIP_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        shutil.rmtree(into, ignore_errors=True)
        raise TargetError(f"{missing} (pip did not finish in {_PIP_TIMEOUT_S} s)") from None
    if done.returncode != 0:
        shutil.rmtree(into, ignore_errors=True)
        last = [ln for ln in (done.stderr or done.stdout).splitlines() if ln.startswith("ERROR")]
        detail = last[-1] if last else f"pip exited {done.returncode}"
        raise TargetError(f"{missing} ({detail.removeprefix('ERROR: ')})")
