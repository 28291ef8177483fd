"""The run directory: where one run's evidence goes.

Layout (a cross-team contract)::

    <run_dir>/workers/<worker-name>.log    each worker's stdout+stderr (and its children's)
    <run_dir>/ledger/<worker-name>.jsonl   accounting events
    <run_dir>/junit/*.xml                  JUnit results
    <run_dir>/report/                      rendered reports
    <run_dir>/ports                        ports handed out in this run (never twice)

The default is ``runs/<UTC timestamp>-<pid>`` under the repository root (``runs/`` is git-ignored).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

#: The repository root (parent of the ``harness`` package).
REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_BASE = REPO_ROOT / "runs"
SUBDIRS = ("workers", "ledger", "junit", "report")


@dataclass(frozen=True)
class RunDir:
    """A created run directory (all sub-directories exist)."""

    root: Path

    @property
    def workers(self) -> Path:
        return self.root / "workers"

    @property
    def ledger(self) -> Path:
        return self.root / "ledger"

    @property
    def junit(self) -> Path:
        return self.root / "junit"

    @property
    def report(self) -> Path:
        return self.root / "report"

    def worker_log(self, name: str) -> Path:
        """``workers/<name>.log``."""
        return self.workers / f"{name}.log"

    def ledger_file(self, name: str) -> Path:
        """``ledger/<name>.jsonl``."""
        return self.ledger / f"{name}.jsonl"

    def __fspath__(self) -> str:
        return str(self.root)

    def __str__(self) -> str:
        return str(self.root)


def default_path(base: Path = DEFAULT_BASE) -> Path:
    """``<base>/<YYYYmmdd-HHMMSS>-<pid>`` (not created)."""
    return base / f"{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{os.getpid()}"


def create(path: str | Path | None = None) -> RunDir:
    """Create a run directory and its sub-directories (existing ones are reused).

    Args:
        path: where; default :func:`default_path`.

    Returns:
        The :class:`RunDir`.

    Raises:
        OSError: the directory cannot be created.
    """
    root = Path(path) if path is not None else default_path()
    for sub in SUBDIRS:
        (root / sub).mkdir(parents=True, exist_ok=True)
    return RunDir(root.resolve())
