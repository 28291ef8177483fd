"""What the nodes of a cluster hold: Ray's view of each (:func:`alive_nodes`: resources, labels, the
harness index), their GPUs (real devices or only Ray resources) and the versions they would import,
asked of every node at once.

:func:`survey` runs one small task on each node; :func:`skew` names a node whose sglang, Ray, Python or torch
differs from this process's. Versions come from package metadata, so a survey imports nothing heavy.
Detail: docs/modules.md.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Mapping

from harness.targets.sglang import selection, travel
from harness.targets.sglang.version import UNKNOWN, read_version
from harness.workers.node_ref import node_index, raylet_answers

SURVEY_TIMEOUT_S = 60.0  # a node may have to start a Ray worker process for the task
#: What :func:`skew` compares between this process and every node.
SKEW_PACKAGES = ("python", "ray", "sglang", "torch")


@dataclass(frozen=True)
class NodeInfo:
    """One alive Ray node, with its harness index (``harness_node_<i>``) when it has one."""

    node_id: str
    ip: str
    index: int | None
    total: dict[str, float] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)


def alive_nodes() -> list[NodeInfo]:
    """The alive nodes, harness-indexed ones first in index order."""
    import ray

    out = []
    for n in ray.nodes():
        if not n.get("Alive"):
            continue
        res = dict(n.get("Resources", {}))
        labels = dict(n.get("Labels") or {})
        out.append(
            NodeInfo(
                node_id=n["NodeID"],
                ip=n.get("NodeManagerAddress", ""),
                index=node_index(res, labels),
                total=res,
                labels=labels,
            )
        )
    return sorted(out, key=lambda n: (n.index is None, n.index if n.index is not None else 0, n.node_id))


@dataclass(frozen=True)
class NodeFacts:
    """One alive node, as it answered :func:`survey`.

    ``gpus`` are the node's Ray GPU resources, ``devices`` the NVIDIA devices the node itself sees
    (None: it did not answer, see ``error``).
    """

    node_id: str
    ip: str
    index: int | None
    gpus: float
    devices: int | None = None
    versions: dict[str, str | None] = field(default_factory=dict)
    error: str | None = None

    @property
    def label(self) -> str:
        """``node1/10.0.0.2`` (harness index known) or ``10.0.0.2/1a2b3c``."""
        return f"node{self.index}/{self.ip}" if self.index is not None else f"{self.ip}/{self.node_id[:6]}"

    @property
    def gpu_kind(self) -> str:
        """``none`` (no Ray GPUs), ``real`` (as many devices as Ray GPUs), ``logical`` or ``unknown``."""
        if not self.gpus:
            return "none"
        if self.devices is None:
            return "unknown"
        return "real" if self.devices >= self.gpus else "logical"


def local_gpus() -> int:
    """NVIDIA GPUs on this machine, from the driver's ``/proc`` entries (no CUDA import)."""
    d = Path("/proc/driver/nvidia/gpus")
    return len(list(d.iterdir())) if d.is_dir() else 0


#: What is compared across nodes, in table order: name -> the distributions that provide it (the
#: first installed one counts; "python" is the interpreter itself).
PACKAGES: dict[str, tuple[str, ...]] = {
    "python": (),
    "torch": ("torch",),
    "ray": ("ray",),
    "sglang": ("sglang",),
    "mooncake": ("mooncake-transfer-engine", "mooncake-transfer-engine-non-cuda"),
}


Versions = dict[str, "str | None"]


def installed_versions(version_of: Callable[[str], str] = importlib.metadata.version) -> Versions:
    """The versions of :data:`PACKAGES` in this interpreter (None: not installed), from metadata.

    Args:
        version_of: the metadata reader (``importlib.metadata.version``; tests pass a dict's getter).

    Returns:
        package name -> version or None.
    """
    out: Versions = {"python": platform.python_version()}
    for name, dists in PACKAGES.items():
        if not dists:
            continue
        if name == "sglang":
            found = _sglang_tree_version()
            if found is not None:  # the tree this interpreter imports, not whatever metadata lies beside it
                out[name] = found
                continue
        out[name] = None
        for dist in dists:
            try:
                version = version_of(dist)
            except importlib.metadata.PackageNotFoundError:
                continue
            # Which distribution provides it matters too (the CUDA and non-CUDA mooncake builds differ).
            out[name] = version if dist == name else f"{version} ({dist})"
            break
    return out


def _sglang_tree_version() -> str | None:
    """The version of the sglang this interpreter runs: the selected target (``$HARNESS_SGLANG``; on a
    node, a shipped tree's copy), else the tree an import would find (its own version file), else
    None (metadata decides). When ``import sglang`` would give another tree than the target's (one
    imported before the target could be selected: a node's ``sitecustomize``, say), that tree's
    version and where it is: what this process would really run."""
    imports = travel.imported_root()
    if os.environ.get(selection.ENV_VAR):
        try:
            target = selection.current()  # the target under test, not the venv's install
        except selection.TargetError as e:
            if imports is None:
                return f"unusable ({e})"
            target = None
        if target is not None and (imports is None or imports == Path(target.root).resolve()):
            return target.version
        assert imports is not None
        return f"{read_version(imports)} from {imports}"
    if imports is None:
        return None
    found = read_version(imports)
    return None if found == UNKNOWN else found


def _node_answer() -> tuple[dict[str, str | None], int]:
    # Runs on the node, in a Ray worker: its interpreter and its machine.
    return installed_versions(), local_gpus()


def survey(timeout: float = SURVEY_TIMEOUT_S) -> list[NodeFacts]:
    """Ask every alive node of the connected cluster for its versions and devices (one task each).

    Args:
        timeout: one deadline for all nodes; a node that did not answer gets ``error``.

    Returns:
        One :class:`NodeFacts` per alive node, harness-indexed nodes first in index order.
    """
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    task = ray.remote(num_cpus=0.01, max_retries=0)(_node_answer)
    asks = []
    lost: list[NodeFacts] = []
    for n in ray.nodes():
        if not n.get("Alive"):
            continue
        res = dict(n.get("Resources", {}))
        base = NodeFacts(
            n["NodeID"], n.get("NodeManagerAddress", ""), node_index(res, n.get("Labels") or {}), res.get("GPU", 0.0)
        )
        gone = raylet_answers(base.ip, int(n.get("NodeManagerPort") or 0))
        if gone:  # listed as alive until the GCS health check gives up; a task there would never start
            lost.append(replace(base, error=f"its raylet {base.ip}:{n.get('NodeManagerPort')}: {gone}"))
            continue
        ref = task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote()
        asks.append((base, ref))
    ready, _ = ray.wait([r for _, r in asks], num_returns=len(asks), timeout=timeout) if asks else ([], [])
    out = lost
    for base, ref in asks:
        if ref not in ready:
            ray.cancel(ref, force=True)
            out.append(replace(base, error=f"did not answer within {timeout:g} s"))
            continue
        try:
            versions, devices = ray.get(ref, timeout=5.0)
        except Exception as e:  # the node died or the task failed there: reported, not raised
            out.append(replace(base, error=" ".join(str(e).split())[:200]))
            continue
        out.append(replace(base, versions=versions, devices=devices))
    return sorted(out, key=lambda f: (f.index is None, f.index or 0, f.node_id))


def skew(nodes: list[NodeFacts], ours: Mapping[str, str | None] | None = None) -> list[str]:
    """Nodes whose :data:`SKEW_PACKAGES` differ from this process's, one line each (empty: none).

    Args:
        nodes: the survey.
        ours: this process's versions (default: :func:`installed_versions`).

    Returns:
        ``"node1/10.0.0.2: sglang 0.5.22 there, 0.5.23 here"`` lines (nodes that did not answer are
        left out: :func:`describe` names them).
    """
    if ours is None:
        ours = installed_versions()
    out = []
    for n in nodes:
        if n.error:  # cannot be judged; describe() shows it, and a run placed there fails on its own
            continue
        diffs = [
            f"{pkg} {n.versions.get(pkg) or 'missing'} there, {ours.get(pkg) or 'missing'} here"
            for pkg in SKEW_PACKAGES
            if n.versions.get(pkg) != ours.get(pkg)
        ]
        if diffs:
            out.append(f"{n.label}: {', '.join(diffs)}")
    return out


def gpu_kind(nodes: list[NodeFacts]) -> str:
    """The cluster's GPUs in one word: ``real``, ``logical`` (any GPU node without its devices), ``none``,
    ``unknown``."""
    kinds = {n.gpu_kind for n in nodes} - {"none"}
    if not kinds:
        return "none"
    for k in ("logical", "unknown"):
        if k in kinds:
            return k
    return "real"


def describe(nodes: list[NodeFacts]) -> str:
    """One line: every node with its GPUs and their kind, e.g. ``node0/10.0.0.1 1 logical GPU; ...``."""
    parts = []
    for n in nodes:
        gpus = f"{n.gpus:g} {n.gpu_kind} GPU(s)" if n.gpus else "no GPUs"
        parts.append(f"{n.label} {gpus}" + (f" (did not answer: {n.error})" if n.error else ""))
    return "; ".join(parts)
