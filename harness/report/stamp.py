"""What a run is stamped with: the harness commit and the sglang target it tested.

:class:`Target` is how a report names the sglang a run tested; the runner builds it from the target it
selected (:func:`harness.targets.sglang.selection.stamp`) and hands it to the page in its
:class:`~harness.report.page.Header`, so nothing here asks which sglang is selected.
"""

from __future__ import annotations

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


#: What a report says when its runner did not name the target.
UNRECORDED = Target("not recorded", "-")


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
