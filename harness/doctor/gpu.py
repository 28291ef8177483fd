"""GPU checks: the devices a topology's bundles got are the model and size it names, are free, and
every node runs the same driver.

The checks are pure functions of :class:`GpuSnapshot`, so tests drive them without a GPU. The real source
is ``nvidia-smi`` (no CUDA context), else ``torch.cuda``. GPU ids are the ones Ray assigned. Detail:
docs/modules.md.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from harness.doctor.result import CheckResult, Limits, Status
from harness.topology import Topology

_SMI_TIMEOUT_S = 10.0  # nvidia-smi blocks for minutes on a GPU that fell off the bus
_MIB = 1 << 20


@dataclass(frozen=True)
class GpuDevice:
    index: int
    uuid: str
    name: str
    memory_total_mib: int
    memory_free_mib: int


@dataclass(frozen=True)
class GpuProcess:
    pid: int
    gpu_uuid: str
    used_mib: int
    command: str


@dataclass(frozen=True)
class GpuSnapshot:
    """What one node's GPUs look like. ``error`` says why nothing could be read."""

    devices: tuple[GpuDevice, ...] = ()
    processes: tuple[GpuProcess, ...] | None = ()  # None: the source cannot list processes
    driver_version: str = ""
    cuda_version: str = ""
    source: str = ""
    error: str | None = None

    def device(self, gpu_id: str | int) -> GpuDevice | None:
        """The device Ray calls ``gpu_id`` (an index or a UUID)."""
        key = str(gpu_id)
        for d in self.devices:
            if str(d.index) == key or d.uuid == key:
                return d
        return None


class DeviceSource(Protocol):
    """Anything that can take a :class:`GpuSnapshot` of the node it runs on."""

    def snapshot(self) -> GpuSnapshot: ...


@dataclass(frozen=True)
class NvidiaSmiSource:
    """Reads the node's GPUs through ``nvidia-smi`` (NVML)."""

    binary: str = "nvidia-smi"
    timeout_s: float = _SMI_TIMEOUT_S

    def _query(self, *args: str) -> str:
        out = subprocess.run([self.binary, *args], capture_output=True, text=True, timeout=self.timeout_s, check=True)
        return out.stdout

    def snapshot(self) -> GpuSnapshot:
        try:
            gpus = self._query(
                "--query-gpu=index,uuid,name,memory.total,memory.free,driver_version", "--format=csv,noheader,nounits"
            )
            apps = self._query(
                "--query-compute-apps=pid,gpu_uuid,used_memory,process_name", "--format=csv,noheader,nounits"
            )
            banner = self._query()
        except subprocess.TimeoutExpired:
            return GpuSnapshot(source="nvidia-smi", error=f"nvidia-smi did not answer within {self.timeout_s:.0f} s")
        except (OSError, subprocess.CalledProcessError) as e:
            err = getattr(e, "stderr", "") or str(e)
            return GpuSnapshot(source="nvidia-smi", error=f"nvidia-smi failed: {err.strip()[:200]}")
        return parse_nvidia_smi(gpus, apps, banner)


def parse_nvidia_smi(gpus_csv: str, apps_csv: str, banner: str) -> GpuSnapshot:
    """Build a snapshot from ``nvidia-smi``'s CSV answers and its banner (for the CUDA version).

    Args:
        gpus_csv: ``--query-gpu=index,uuid,name,memory.total,memory.free,driver_version`` output.
        apps_csv: ``--query-compute-apps=pid,gpu_uuid,used_memory,process_name`` output.
        banner: plain ``nvidia-smi`` output.

    Returns:
        The snapshot; process commands are read from ``/proc/PID/cmdline`` where visible.
    """
    devices, drivers = [], set()
    for line in filter(None, (ln.strip() for ln in gpus_csv.splitlines())):
        idx, uuid, name, total, free, driver = (c.strip() for c in line.split(","))
        devices.append(GpuDevice(int(idx), uuid, name, _int(total), _int(free)))
        drivers.add(driver)
    procs = []
    for line in filter(None, (ln.strip() for ln in apps_csv.splitlines())):
        pid, uuid, used, name = (c.strip() for c in line.split(",", 3))
        procs.append(GpuProcess(int(pid), uuid, _int(used), _command(int(pid), name)))
    m = re.search(r"CUDA Version:\s*([\d.]+)", banner)
    return GpuSnapshot(tuple(devices), tuple(procs), ",".join(sorted(drivers)), m.group(1) if m else "", "nvidia-smi")


def _int(s: str) -> int:
    try:
        return int(float(s))
    except ValueError:  # "[N/A]" on some MIG setups
        return 0


def _command(pid: int, fallback: str) -> str:
    # The process may live in another PID namespace (containers): then only nvidia-smi's name is known.
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return fallback
    return raw.replace(b"\0", b" ").decode(errors="replace").strip()[:200] or fallback


@dataclass(frozen=True)
class TorchSource:
    """Reads the GPUs through ``torch.cuda`` (creates a CUDA context; cannot list processes)."""

    def snapshot(self) -> GpuSnapshot:
        try:
            import torch
        except ImportError as e:
            return GpuSnapshot(source="torch", error=f"neither nvidia-smi nor torch is available: {e}")
        if not torch.cuda.is_available():
            return GpuSnapshot(source="torch", error="torch.cuda.is_available() is False and nvidia-smi is missing")
        devices = []
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            free, total = torch.cuda.mem_get_info(i)
            devices.append(GpuDevice(i, str(getattr(props, "uuid", i)), props.name, total // _MIB, free // _MIB))
        return GpuSnapshot(tuple(devices), None, "", torch.version.cuda or "", "torch")


@dataclass(frozen=True)
class StaticSource:
    """A fixed snapshot: one taken elsewhere, or hand-built in the harness's own tests."""

    fixed: GpuSnapshot

    def snapshot(self) -> GpuSnapshot:
        return self.fixed


@dataclass(frozen=True)
class SimulatedSource:
    """``--simulate``: nothing to look at. Checks turn every GPU row into ``simulated``."""

    def snapshot(self) -> GpuSnapshot:
        return GpuSnapshot(source="simulated")


def default_source() -> DeviceSource:
    """``nvidia-smi`` when on PATH, else ``torch.cuda``."""
    return NvidiaSmiSource() if shutil.which("nvidia-smi") else TorchSource()


# --------------------------------------------------------------------------------------------
# checks (pure)
# --------------------------------------------------------------------------------------------

_FIX_QUERY = "make `nvidia-smi` work on this node (driver loaded, GPUs not fallen off the bus), then rerun"


def simulated_rows(node: str, gpu_ids: list[str]) -> list[CheckResult]:
    """The GPU rows of one simulated bundle: each says what Ray assigned and that nothing was queried."""
    ids = ",".join(gpu_ids) or "-"
    return [
        CheckResult(c, Status.SIMULATED, f"Ray logical GPU(s) {ids}; no real device queried", node=node, gpu=ids)
        for c in ("gpu.model", "gpu.memory", "gpu.free_memory", "gpu.processes")
    ]


def logical_row(node: str, ray_gpus: float, devices: int | None) -> CheckResult:
    """The ``gpu.count`` row of a joined node whose Ray GPUs are logical (fewer devices than Ray GPUs).

    Args:
        node: the node's label.
        ray_gpus: the node's Ray GPU resources.
        devices: the GPU devices the node itself sees.

    Returns:
        One failed row: a real-GPU topology cannot be validated on resources without devices.
    """
    return CheckResult(
        "gpu.count",
        Status.FAILED,
        f"{ray_gpus:g} Ray GPU(s) but {devices or 0} GPU device(s) on the node: logical GPUs "
        "(`ray start --num-gpus` on a machine without them)",
        "join nodes whose GPUs are real, or validate a CPU machine with `--simulate` instead",
        node=node,
    )


def check_node(topology: Topology, node: str, snap: GpuSnapshot) -> list[CheckResult]:
    """Node-level GPU check: the node shows as many GPUs as the topology's ``gpus_per_node``.

    Args:
        topology: what the node should hold.
        node: the node's label for the table.
        snap: the node's snapshot.

    Returns:
        One ``gpu.count`` row.
    """
    if snap.error:
        return [CheckResult("gpu.count", Status.FAILED, snap.error, _FIX_QUERY, node=node)]
    want, have = topology.gpus_per_node, len(snap.devices)
    if have >= want:
        return [CheckResult("gpu.count", Status.PASSED, f"{have} GPU(s) visible, topology needs {want}", node=node)]
    return [
        CheckResult(
            "gpu.count",
            Status.FAILED,
            f"only {have} GPU(s) visible, topology needs {want}",
            "find the missing GPU(s) (`nvidia-smi -L`, dmesg for Xid errors) or drain this node",
            node=node,
        )
    ]


def check_bundle(
    topology: Topology,
    node: str,
    gpu_ids: list[str],
    snap: GpuSnapshot,
    limits: Limits,
    own_pids: frozenset[int] = frozenset(),
) -> list[CheckResult]:
    """Per-GPU checks of one bundle: model, memory size, free memory, foreign processes.

    Args:
        topology: gives ``gpu_model`` and ``gpu_memory_gb``.
        node: the node's label.
        gpu_ids: the GPU ids Ray assigned to the bundle.
        snap: the node's snapshot.
        limits: ``min_gpu_free_fraction`` and ``gpu_memory_tolerance``.
        own_pids: the harness's own processes (never counted as foreign).

    Returns:
        Four rows per GPU (``gpu.model``, ``gpu.memory``, ``gpu.free_memory``, ``gpu.processes``).
    """
    rows: list[CheckResult] = []
    for gid in gpu_ids:
        rows += _check_one(topology, node, str(gid), snap, limits, own_pids)
    return rows


def _check_one(
    topology: Topology, node: str, gid: str, snap: GpuSnapshot, limits: Limits, own_pids: frozenset[int]
) -> list[CheckResult]:
    names = ("gpu.model", "gpu.memory", "gpu.free_memory", "gpu.processes")
    if snap.error:
        return [CheckResult(n, Status.FAILED, snap.error, _FIX_QUERY, node=node, gpu=gid) for n in names]
    dev = snap.device(gid)
    if dev is None:
        seen = ",".join(str(d.index) for d in snap.devices) or "none"
        return [
            CheckResult(
                n,
                Status.FAILED,
                f"Ray assigned GPU {gid} but the node shows GPUs {seen}",
                "restart the Ray node so its GPU resources match the devices (`ray stop; ray start ...`)",
                node=node,
                gpu=gid,
            )
            for n in names
        ]
    rows = []
    want_model = topology.gpu_model or ""
    if want_model.lower() in dev.name.lower():
        rows.append(CheckResult("gpu.model", Status.PASSED, f"{dev.name}", node=node, gpu=gid))
    else:
        rows.append(
            CheckResult(
                "gpu.model",
                Status.FAILED,
                f"{dev.name}, topology needs {want_model}",
                f"run on a node with {want_model} GPUs (runner {topology.runner}) or pick the topology for {dev.name}",
                node=node,
                gpu=gid,
            )
        )
    total_gib = dev.memory_total_mib / 1024
    want_gb = topology.gpu_memory_gb or 0.0
    off = abs(total_gib - want_gb) / want_gb if want_gb else 0.0
    if off <= limits.gpu_memory_tolerance:
        rows.append(
            CheckResult(
                "gpu.memory", Status.PASSED, f"{total_gib:.1f} GiB (topology {want_gb:g} GB)", node=node, gpu=gid
            )
        )
    else:
        rows.append(
            CheckResult(
                "gpu.memory",
                Status.FAILED,
                f"{total_gib:.1f} GiB, topology needs {want_gb:g} GB (±{limits.gpu_memory_tolerance:.0%})",
                f"use GPUs with {want_gb:g} GB or fix cluster.gpu_memory_gb in {topology.name}.toml",
                node=node,
                gpu=gid,
            )
        )
    frac = dev.memory_free_mib / dev.memory_total_mib if dev.memory_total_mib else 0.0
    detail = f"{dev.memory_free_mib / 1024:.1f} of {total_gib:.1f} GiB free ({frac:.0%})"
    if frac >= limits.min_gpu_free_fraction:
        rows.append(CheckResult("gpu.free_memory", Status.PASSED, detail, node=node, gpu=gid))
    else:
        rows.append(
            CheckResult(
                "gpu.free_memory",
                Status.FAILED,
                f"{detail}, need ≥ {limits.min_gpu_free_fraction:.0%}",
                "free the GPU: stop what holds its memory (see gpu.processes) and rerun",
                node=node,
                gpu=gid,
            )
        )
    rows.append(_check_processes(node, gid, dev, snap, own_pids))
    return rows


def _check_processes(node: str, gid: str, dev: GpuDevice, snap: GpuSnapshot, own_pids: frozenset[int]) -> CheckResult:
    if snap.processes is None:
        return CheckResult(
            "gpu.processes",
            Status.FAILED,
            f"{snap.source} cannot list GPU processes",
            "install nvidia-smi (NVIDIA driver utilities) on this node so foreign processes can be found",
            node=node,
            gpu=gid,
        )
    foreign = [p for p in snap.processes if p.gpu_uuid == dev.uuid and p.pid not in own_pids]
    if not foreign:
        return CheckResult("gpu.processes", Status.PASSED, "no other process holds memory", node=node, gpu=gid)
    listed = "; ".join(f"pid {p.pid} ({p.used_mib} MiB): {p.command}" for p in foreign)
    pids = " ".join(str(p.pid) for p in foreign)
    return CheckResult(
        "gpu.processes",
        Status.FAILED,
        f"{len(foreign)} foreign process(es): {listed}",
        f"stop them if they are leftovers (`kill {pids}`; `kill -9 {pids}` if they ignore it)",
        node=node,
        gpu=gid,
    )


def check_versions_equal(snaps: dict[str, GpuSnapshot]) -> list[CheckResult]:
    """Cross-node check: driver and CUDA versions are the same on every node.

    Args:
        snaps: node label -> snapshot (nodes whose snapshot has an error are left out).

    Returns:
        One ``gpu.driver`` row with node ``all``.
    """
    seen = {n: (s.driver_version, s.cuda_version) for n, s in snaps.items() if not s.error}
    if not seen:
        return [CheckResult("gpu.driver", Status.FAILED, "no node could report its driver", _FIX_QUERY, node="all")]
    distinct = set(seen.values())
    if len(distinct) == 1:
        drv, cuda = distinct.pop()
        return [
            CheckResult("gpu.driver", Status.PASSED, f"driver {drv}, CUDA {cuda} on {len(seen)} node(s)", node="all")
        ]
    listed = "; ".join(f"{n}: driver {d}, CUDA {c}" for n, (d, c) in sorted(seen.items()))
    return [
        CheckResult(
            "gpu.driver",
            Status.FAILED,
            f"versions differ: {listed}",
            "install the same NVIDIA driver on every node (NCCL and the KV transfer need it)",
            node="all",
        )
    ]
