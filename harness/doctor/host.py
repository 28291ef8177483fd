"""Host checks: free disk where the run writes, the open-file limit, and the size of /dev/shm.

:func:`host_facts` reads the node (in a probe actor); :func:`check_host` judges the facts against
:class:`~harness.doctor.result.Limits` and is pure.
"""

from __future__ import annotations

import os
import resource
import shutil
from dataclasses import dataclass
from pathlib import Path

from harness.doctor.result import CheckResult, Limits, Status

_GIB = 1 << 30


@dataclass(frozen=True)
class HostFacts:
    run_dir: str  # the directory measured: the run directory or its nearest existing parent
    disk_free_bytes: int
    nofile_soft: int
    nofile_hard: int
    shm_bytes: int | None  # None: no /dev/shm


def _existing(path: Path) -> Path:
    # The run directory is created by the run; before it exists, its filesystem is its parent's.
    p = path.resolve()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def host_facts(run_dir: str | os.PathLike[str], shm: str = "/dev/shm") -> HostFacts:
    """Read this node's facts.

    Args:
        run_dir: where the run writes (need not exist yet).
        shm: the shared-memory mount.

    Returns:
        The facts.
    """
    where = _existing(Path(run_dir))
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    infinity = resource.RLIM_INFINITY
    try:
        st = os.statvfs(shm)
        shm_bytes: int | None = st.f_frsize * st.f_blocks
    except OSError:
        shm_bytes = None
    return HostFacts(
        run_dir=str(where),
        disk_free_bytes=shutil.disk_usage(where).free,
        nofile_soft=1 << 62 if soft == infinity else soft,
        nofile_hard=1 << 62 if hard == infinity else hard,
        shm_bytes=shm_bytes,
    )


def check_host(node: str, facts: HostFacts, limits: Limits) -> list[CheckResult]:
    """Judge one node's facts.

    Args:
        node: the node's label.
        facts: from :func:`host_facts` on that node.
        limits: ``min_disk_free_gib``, ``min_open_files``, ``min_shm_gib``.

    Returns:
        ``host.disk``, ``host.open_files`` and ``host.shm`` rows.
    """
    rows = []
    free = facts.disk_free_bytes / _GIB
    detail = f"{free:.1f} GiB free in {facts.run_dir}"
    if free >= limits.min_disk_free_gib:
        rows.append(CheckResult("host.disk", Status.PASSED, detail, node=node))
    else:
        rows.append(
            CheckResult(
                "host.disk",
                Status.FAILED,
                f"{detail}, need ≥ {limits.min_disk_free_gib:g} GiB",
                "free space there (old runs/ directories, ~/.cache) or pass --run-dir on a larger disk",
                node=node,
            )
        )
    # sglang raises the soft limit to the hard one itself, so the hard limit is what a server gets.
    usable = max(facts.nofile_soft, facts.nofile_hard)
    detail = f"open files: soft {_lim(facts.nofile_soft)}, hard {_lim(facts.nofile_hard)}"
    if usable >= limits.min_open_files:
        rows.append(CheckResult("host.open_files", Status.PASSED, detail, node=node))
    else:
        rows.append(
            CheckResult(
                "host.open_files",
                Status.FAILED,
                f"{detail}, need ≥ {limits.min_open_files}",
                f"raise it: `ulimit -n {limits.min_open_files}` before `ray start`, or nofile in "
                "/etc/security/limits.conf (docker: --ulimit nofile=65535:65535)",
                node=node,
            )
        )
    if facts.shm_bytes is None:
        rows.append(
            CheckResult(
                "host.shm",
                Status.FAILED,
                "/dev/shm is missing",
                "mount a tmpfs on /dev/shm (docker: --shm-size 16g or --ipc host)",
                node=node,
            )
        )
    else:
        shm = facts.shm_bytes / _GIB
        detail = f"/dev/shm {shm:.1f} GiB"
        if shm >= limits.min_shm_gib:
            rows.append(CheckResult("host.shm", Status.PASSED, detail, node=node))
        else:
            rows.append(
                CheckResult(
                    "host.shm",
                    Status.FAILED,
                    f"{detail}, need ≥ {limits.min_shm_gib:g} GiB (NCCL and gloo use it)",
                    "enlarge it (docker: --shm-size 16g or --ipc host; else `mount -o remount,size=16G /dev/shm`)",
                    node=node,
                )
            )
    return rows


def _lim(v: int) -> str:
    return "unlimited" if v >= 1 << 62 else str(v)
