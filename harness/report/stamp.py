"""What a run is stamped with: the harness commit and the sglang target it tested.

:func:`sglang_target` is the one place reports ask which sglang a run tested. It describes the target
the run selected (``--sglang`` / ``HARNESS_SGLANG``; :mod:`harness.targets.sglang.selection`, which
resolves it from the tree's files, never by importing sglang): a release, a source tree (its git
commit and dirty state) or a wheel; for the installed distribution, where it was installed from and,
for a VCS or local install, its commit, from its metadata (PEP 610 ``direct_url.json``).
"""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Target:
    """The sglang a run tested.

    Attributes:
        version: its version (``not installed`` when absent).
        origin: where it came from: a URL or path for a direct install, else ``package index``.
        commit: the VCS commit of a git install, else ``""``.
    """

    version: str
    origin: str
    commit: str = ""

    def describe(self) -> str:
        """One line: ``sglang 0.5.23 (package index)`` or ``sglang 0.5.24.dev0 (git URL @ abc123def456)``."""
        where = self.origin + (f" @ {self.commit[:12]}" if self.commit else "")
        return f"sglang {self.version} ({where})"


def sglang_target(dist: str = "sglang") -> Target:
    """The sglang target of this run.

    Args:
        dist: the distribution name (for the installed target).

    Returns:
        Its :class:`Target` (``Target("not installed", "-")`` when no sglang can be found).
    """
    from harness.targets.sglang import selection as target_mod

    try:
        selected = target_mod.current()
    except target_mod.TargetError:
        return Target("not installed", "-")
    if selected.origin != target_mod.INSTALLED:
        dirty = ", dirty" if selected.dirty else ""
        return Target(selected.version, f"{selected.origin} {selected.root}{dirty}", selected.commit or "")
    try:
        d = importlib.metadata.distribution(dist)
    except importlib.metadata.PackageNotFoundError:
        return Target("not installed", "-")
    origin, commit = "package index", ""
    raw = d.read_text("direct_url.json")
    if raw:
        try:
            info = json.loads(raw)
            origin = str(info.get("url") or origin)
            commit = str((info.get("vcs_info") or {}).get("commit_id") or "")
        except (json.JSONDecodeError, AttributeError):
            pass  # a broken PEP 610 file: the version alone still says what ran
    return Target(d.version, origin, commit)


def git_state(repo_root: Path) -> tuple[str, bool]:
    """The harness commit.

    Args:
        repo_root: the repository.

    Returns:
        (HEAD's SHA or ``unknown`` outside git, whether tracked files have uncommitted changes).
    """
    def git(*args: str) -> str | None:
        try:
            r = subprocess.run(["git", *args], cwd=repo_root, capture_output=True, text=True, timeout=20, check=False)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return r.stdout.strip() if r.returncode == 0 else None

    sha = git("rev-parse", "HEAD")
    if not sha:
        return "unknown", False
    return sha, bool(git("status", "--porcelain", "--untracked-files=no"))
