"""The run directory: where one run's evidence goes.

Layout (a cross-team contract)::

    <run_dir>/workers/<worker-name>.log    each worker's stdout+stderr (and its children's)
    <run_dir>/ledger/<worker-name>.jsonl   accounting events
    <run_dir>/kv_heads/<worker>.rank<R>.<pid>.jsonl  unequal prefill/decode TP: each rank's per-head KV digests
    <run_dir>/junit/*.xml                  JUnit results
    <run_dir>/report/                      rendered reports
    <run_dir>/ports                        ports handed out in this run (never twice)
    <run_dir>/tests.jsonl                  one line per test: what it wrote (harness.plugins.record)

The default is ``runs/<UTC timestamp>-<pid>`` under the repository root (``runs/`` is git-ignored).
"""

from __future__ import annotations

import hashlib
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

#: Env var naming the repository root where the ``harness`` package imported is a copy outside it
#: (a joined cluster's workers run the one Ray unpacked: :mod:`harness.cluster.carry` sets it to the driver's).
REPO_ROOT_ENV = "HARNESS_REPO_ROOT"
#: The repository root (parent of the ``harness`` package, or ``$HARNESS_REPO_ROOT``).
REPO_ROOT = Path(os.environ.get(REPO_ROOT_ENV) or Path(__file__).resolve().parent.parent)
#: The runs directory's name under a repository root (git-ignored).
RUNS = "runs"
DEFAULT_BASE = REPO_ROOT / RUNS
SUBDIRS = ("workers", "ledger", "junit", "report")
#: The time in a default run directory's name (UTC; :func:`default_path`).
TIME_FORMAT = "%Y%m%d-%H%M%S"
#: The per-test record file of a pytest run directory (:mod:`harness.plugins.record` writes it).
RECORD_FILE = "tests.jsonl"


@dataclass(frozen=True)
class RunDir:
    """A run directory's layout: every path of one is built here (:func:`create` also makes the
    sub-directories; ``RunDir(path)`` only names them).

    >>> run = RunDir(Path("/runs/r1"))
    >>> run.worker_log("decode-0"), run.ledger_file("decode-0")
    (PosixPath('/runs/r1/workers/decode-0.log'), PosixPath('/runs/r1/ledger/decode-0.jsonl'))
    >>> run.junit_file("cpu")
    PosixPath('/runs/r1/junit/cpu.xml')
    """

    root: Path

    @property
    def workers(self) -> Path:
        return self.root / "workers"

    @property
    def ledger(self) -> Path:
        return self.root / "ledger"

    @property
    def kv_heads(self) -> Path:
        """``kv_heads/``: per-rank head digests of a server of unequal prefill/decode TP (made by its writer)."""
        return self.root / "kv_heads"

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

    def junit_file(self, name: str) -> Path:
        """``junit/<name>.xml`` (one pytest run's, e.g. a group's)."""
        return self.junit / f"{name}.xml"

    @property
    def ports(self) -> Path:
        """``ports``: the ports handed out in this run."""
        return self.root / "ports"

    @property
    def records(self) -> Path:
        """``tests.jsonl``: the per-test records."""
        return self.root / RECORD_FILE

    def __fspath__(self) -> str:
        return str(self.root)

    def __str__(self) -> str:
        return str(self.root)


def default_path(base: Path = DEFAULT_BASE, *, kind: str = "", suffix: str = "") -> Path:
    """``<base>/[<kind>-]<YYYYmmdd-HHMMSS>-<pid>[-<suffix>]``, the time in UTC (not created): every
    command's default run directory is named here (``kind``: ``matrix``, ``mutate``, ``faults``, ...).

    >>> default_path(Path("/runs"), kind="mutate").name.startswith("mutate-")
    True
    """
    name = f"{time.strftime(TIME_FORMAT, time.gmtime())}-{os.getpid()}"
    return base / "-".join(part for part in (kind, name, suffix) if part)


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


def safe_name(text: str, limit: int = 120) -> str:
    """A file or directory name for ``text`` (a node id, a suite and group): letters, digits, ``_.-`` only, never
    hidden or ``..``, at most ``limit`` characters; when cut, it ends in a short hash of the whole text, so two
    node ids that differ only past the cut (a long parametrize id) still get two names.

    >>> safe_name("suites/a/test_x.py::test_y[p]")
    'suites_a_test_x.py_test_y_p'
    >>> a, b = (safe_name("t.py::test[" + "x" * 200 + c + "]") for c in "ab")
    >>> len(a) == 120 and a != b and a[:100] == b[:100]
    True
    >>> safe_name("../..")
    '_'
    """
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_.") or "_"
    if len(name) > limit:
        digest = hashlib.sha1(text.encode()).hexdigest()[:10]
        name = f"{name[: limit - len(digest) - 1]}-{digest}"
    return name
