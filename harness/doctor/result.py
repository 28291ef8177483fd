"""What a doctor check produces: one :class:`CheckResult` row per check, node and GPU, and the limits.

A row's status is one of :class:`Status`. ``simulated`` counts as a pass with a note (``--simulate``
has no real device to look at), ``hung`` means a probe did not answer within its timeout, ``skipped``
means the check could not run because an earlier one failed (placement, a hung probe). Only
``passed`` and ``simulated`` rows let ``harness doctor`` exit 0.
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field
from typing import Any


class Status(str, enum.Enum):
    PASSED = "passed"
    SIMULATED = "simulated"
    FAILED = "failed"
    HUNG = "hung"
    SKIPPED = "skipped"

    @property
    def ok(self) -> bool:
        return self in (Status.PASSED, Status.SIMULATED)


@dataclass(frozen=True)
class CheckResult:
    """One row of the doctor's table.

    ``fix`` is required for every status that is not ok: a failure nobody can act on is noise.
    """

    check: str  # family.name, e.g. "gpu.model"
    status: Status
    detail: str
    fix: str = ""
    node: str = "-"  # node label (ip and short Ray node id) or "all" for a cross-node check
    gpu: str = "-"  # GPU ids as Ray assigned them on that node, "-" when none

    def __post_init__(self) -> None:
        if not self.status.ok and not self.fix:
            raise ValueError(f"check {self.check!r} is {self.status.value} without a fix hint")

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["status"] = self.status.value
        return d


@dataclass(frozen=True)
class Limits:
    """Thresholds and timeouts of every check, stated once. The CLI and tests override fields."""

    check_timeout_s: float = 20.0  # per check family round (all probes answer within it, or are hung)
    start_timeout_s: float = 45.0  # probe actors placed and answering their first call
    min_gpu_free_fraction: float = 0.90  # of total memory, on every assigned GPU
    gpu_memory_tolerance: float = 0.05  # |reported - topology| / topology (80 GB H100 reports 79.6 GiB)
    min_disk_free_gib: float = 10.0  # in the run directory
    min_open_files: int = 16384  # achievable RLIMIT_NOFILE (sglang raises the soft limit to the hard one)
    min_shm_gib: float = 1.0  # /dev/shm; docker's 64 MiB default breaks NCCL and gloo
    transfer_bytes: int = 4 << 20  # per prefill/decode pair, for the transfer self-test
    rtt_pings: int = 5


@dataclass(frozen=True)
class Report:
    """All rows of one doctor run, in table order."""

    topology: str
    simulated: bool
    rows: tuple[CheckResult, ...]
    wall_s: float = 0.0
    cluster: str = ""  # how the cluster was reached: "local (simulated)", "joined ADDR", ...
    notes: tuple[str, ...] = field(default=())

    @property
    def ok(self) -> bool:
        return all(r.status.ok for r in self.rows) and bool(self.rows)

    @property
    def exit_code(self) -> int:
        return 0 if self.ok else 1

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in self.rows:
            out[r.status.value] = out.get(r.status.value, 0) + 1
        return out

    def failed(self) -> tuple[CheckResult, ...]:
        return tuple(r for r in self.rows if not r.status.ok)
