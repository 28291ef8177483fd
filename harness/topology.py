"""Typed, validated topologies: the one object that drives placement, ports, runner labels and reports.

A topology file (``topologies/NAME.toml``) says what cluster a suite needs and how the prefill, decode and
router roles sit on it. ``load`` validates everything at load time; every problem is one
:class:`TopologyError` naming the file, the key and the fix. Defaults live only here. The file's shape:
docs/modules.md. Over 400 lines: the schema and its validation are one (each key's check beside its default).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from harness import engineargs, tomlcheck

#: Where the shipped topologies live (the repository's ``topologies/``).
TOPOLOGY_DIR = Path(__file__).resolve().parent.parent / "topologies"

ROLE_KINDS = ("prefill", "decode", "router")
DEFAULT_CPUS_PER_RANK = 0.1  # Ray CPUs per actor; small because the CPU machine has 2 cores.

_TOP_KEYS = {"name", "description", "runner", "allow_simulation", "transfer_backend", "kv_heads", "cluster", "roles"}
_CLUSTER_KEYS = {"nodes", "gpus_per_node", "gpu_model", "gpu_memory_gb", "cpus_per_node"}
_ROLE_KEYS = {"kind", "count", "tp", "dp", "gpus_per_rank", "cpus_per_rank", "node", "engine_args", "dp_attention"}
_TRANSFER_BACKENDS = ("mooncake", "nixl", "mori", "ray", "fake")


class TopologyError(ValueError):
    """A topology file is missing, malformed or inconsistent. The message is one line: file, key, fix."""


@dataclass(frozen=True)
class RoleSpec:
    """One role (prefill, decode or router) of a topology.

    ``count`` instances, each a data-parallel group of ``dp`` replicas, each replica a TP group of
    ``tp`` ranks, each rank holding ``gpus_per_rank`` GPUs.
    """

    name: str
    kind: str
    count: int = 1
    tp: int = 1
    dp: int = 1
    gpus_per_rank: int = 0
    cpus_per_rank: float = DEFAULT_CPUS_PER_RANK
    node: int | None = None
    engine_args: tuple[str, ...] = ()
    dp_attention: bool = False

    @property
    def groups(self) -> int:
        """Placement groups this role needs: one per instance and DP replica (attention-DP replicas
        share their instance's TP group, so then one per instance)."""
        return self.count * (1 if self.dp_attention else self.dp)

    @property
    def attn_tp(self) -> int:
        """The attention TP size sglang slices KV heads over: ``tp``, or ``tp // dp`` with DP attention."""
        return self.tp // self.dp if self.dp_attention else self.tp

    @property
    def gpus_per_group(self) -> int:
        return self.tp * self.gpus_per_rank

    @property
    def total_gpus(self) -> int:
        return self.groups * self.gpus_per_group

    def bundles(self) -> list[dict[str, float]]:
        """Ray bundles of one TP group: one per rank."""
        bundle: dict[str, float] = {"CPU": self.cpus_per_rank}
        if self.gpus_per_rank:
            bundle["GPU"] = float(self.gpus_per_rank)
        return [dict(bundle) for _ in range(self.tp)]


@dataclass(frozen=True)
class Topology:
    """A validated topology. Build it with :func:`load` or :func:`get`."""

    name: str
    runner: str
    nodes: int
    gpus_per_node: int
    roles: tuple[RoleSpec, ...]
    description: str = ""
    gpu_model: str | None = None
    gpu_memory_gb: float | None = None
    cpus_per_node: float | None = None
    allow_simulation: bool = True
    transfer_backend: str = "mooncake"
    kv_heads: int | None = None  # the KV heads of the model it is sized for (heterogeneous PD); None: any
    path: Path | None = field(default=None, compare=False)

    @property
    def total_gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def needs_gpus(self) -> bool:
        return self.total_gpus > 0

    def role(self, name: str) -> RoleSpec:
        """Return the role called ``name``.

        Raises:
            KeyError: the topology has no such role.
        """
        for r in self.roles:
            if r.name == name:
                return r
        raise KeyError(f"topology {self.name!r} has no role {name!r} (roles: {', '.join(self.role_names)})")

    @property
    def role_names(self) -> tuple[str, ...]:
        return tuple(r.name for r in self.roles)

    def roles_of(self, kind: str) -> tuple[RoleSpec, ...]:
        return tuple(r for r in self.roles if r.kind == kind)

    @property
    def requirement(self) -> str:
        """Human summary of the hardware, e.g. ``2×H100 (runner 2-gpu-h100)``."""
        if not self.needs_gpus:
            return f"CPU only (runner {self.runner})"
        nodes = f"{self.nodes} nodes × " if self.nodes > 1 else ""
        return f"{nodes}{self.gpus_per_node}×{self.gpu_model or 'GPU'} (runner {self.runner})"

    def summary(self) -> dict[str, Any]:
        """A JSON-able description for reports and ``harness topology show``."""
        return {
            "name": self.name,
            "description": self.description,
            "runner": self.runner,
            "nodes": self.nodes,
            "gpus_per_node": self.gpus_per_node,
            "gpu_model": self.gpu_model,
            "gpu_memory_gb": self.gpu_memory_gb,
            "allow_simulation": self.allow_simulation,
            "transfer_backend": self.transfer_backend,
            "kv_heads": self.kv_heads,
            "roles": [
                {
                    "name": r.name,
                    "kind": r.kind,
                    "count": r.count,
                    "tp": r.tp,
                    "dp": r.dp,
                    "gpus_per_rank": r.gpus_per_rank,
                    "cpus_per_rank": r.cpus_per_rank,
                    "node": r.node,
                    "dp_attention": r.dp_attention,
                    "engine_args": list(r.engine_args),
                }
                for r in self.roles
            ],
        }


# --------------------------------------------------------------------------------------------
# loading and validation
# --------------------------------------------------------------------------------------------


_fail = partial(tomlcheck.fail, TopologyError)
_take = partial(tomlcheck.take, TopologyError)
_check_unknown = partial(tomlcheck.check_unknown, TopologyError)


#: The largest count a topology may give (nodes, ranks, tp, dp, instances): far above any real cluster, and small
#: enough that every loop over a topology ends at once.
MAX_COUNT = 1024
#: The largest GPUs per node or per rank, GPU memory (GB) and CPUs per node a topology may give.
MAX_GPUS_PER_NODE = 64
MAX_GPU_MEMORY_GB = 4096
MAX_CPUS_PER_NODE = 4096


def _positive(value: int, where: str, key: str, minimum: int = 1, maximum: int = MAX_COUNT) -> int:
    if value < minimum:
        raise _fail(where, key, f"must be ≥ {minimum}, got {value}", f"set {key} = {minimum} or more")
    if value > maximum:
        raise _fail(where, key, f"must be ≤ {maximum}, got {value}", f"set {key} to at most {maximum}")
    return value


def _parse_role(name: str, table: Any, where: str) -> RoleSpec:
    ctx = f"roles.{name}."
    if not isinstance(table, dict):
        raise _fail(where, f"roles.{name}", "must be a table", f"write it as [roles.{name}]")
    _check_unknown(table, _ROLE_KEYS, where, ctx)
    kind = _take(table, "kind", str, name, where, ctx)
    if kind not in ROLE_KINDS:
        raise _fail(where, f"{ctx}kind", f"unknown role kind {kind!r}", f"use one of {', '.join(ROLE_KINDS)}")
    engine_args = _take(table, "engine_args", list, [], where, ctx)
    if not all(isinstance(a, str) for a in engine_args):
        raise _fail(where, f"{ctx}engine_args", "must be a list of strings", 'write e.g. ["--enable-dp-attention"]')
    cpus = _take(table, "cpus_per_rank", (int, float), DEFAULT_CPUS_PER_RANK, where, ctx)
    if cpus <= 0:
        raise _fail(where, f"{ctx}cpus_per_rank", f"must be > 0, got {cpus}", "use a small fraction such as 0.1")
    tomlcheck.number(
        TopologyError, cpus, where, f"{ctx}cpus_per_rank", 0.0, MAX_CPUS_PER_NODE, "use a small fraction such as 0.1"
    )
    node = _take(table, "node", int, None, where, ctx)
    if node is not None:
        _positive(node, where, f"{ctx}node", minimum=0)
    default_gpus = 0 if kind == "router" else 1
    tp, dp, dp_attention = _parallelism(table, tuple(engine_args), where, ctx)
    role = RoleSpec(
        name=name,
        kind=kind,
        count=_positive(_take(table, "count", int, 1, where, ctx), where, f"{ctx}count"),
        tp=tp,
        dp=dp,
        gpus_per_rank=_positive(
            _take(table, "gpus_per_rank", int, default_gpus, where, ctx),
            where,
            f"{ctx}gpus_per_rank",
            0,
            MAX_GPUS_PER_NODE,
        ),
        cpus_per_rank=float(cpus),
        node=node,
        engine_args=tuple(engine_args),
        dp_attention=dp_attention,
    )
    if role.dp_attention and role.dp < 2:
        raise _fail(where, f"{ctx}dp_attention", "needs dp ≥ 2", f"set {ctx}dp to 2 or more, or drop dp_attention")
    return role


def _parallelism(table: dict[str, Any], engine_args: tuple[str, ...], where: str, ctx: str) -> tuple[int, int, bool]:
    """``(tp, dp, dp_attention)`` of a role: as the table says them, else as its engine arguments do;
    a table value that its engine arguments contradict is refused (the server would run otherwise
    than the topology places it)."""
    try:
        said = engineargs.parallelism(engine_args)
    except ValueError as e:
        what, _, fix = str(e).partition("; ")
        raise _fail(where, f"{ctx}engine_args", what, fix) from None
    out: dict[str, Any] = {}
    for key, derived in said.items():
        given = _take(table, key, bool if key == "dp_attention" else int, None, where, ctx)
        if given is not None and derived is not None and given != derived:
            flags = engineargs.PARALLEL_FLAGS[key]
            flag_text = flags[0] if key == "dp_attention" else f"{flags[1]} {derived}"
            raise _fail(
                where,
                f"{ctx}{key}",
                f"is {str(given).lower()} but engine_args say {flag_text}",
                f"drop {ctx}{key} (it is read from engine_args) or make the two agree",
            )
        out[key] = given if given is not None else derived
    tp = _positive(out["tp"] if out["tp"] is not None else 1, where, f"{ctx}tp")
    dp = _positive(out["dp"] if out["dp"] is not None else 1, where, f"{ctx}dp")
    return tp, dp, bool(out["dp_attention"])


def parse(data: dict[str, Any], where: str) -> Topology:
    """Validate a parsed TOML document and build the :class:`Topology`.

    Args:
        data: the TOML document as a dict.
        where: the file name used in error messages.

    Returns:
        The validated topology.

    Raises:
        TopologyError: the first problem found, naming ``where``, the key and the fix.
    """
    _check_unknown(data, _TOP_KEYS, where, "")
    name = _take(data, "name", str, None, where, "")
    if not name:
        raise _fail(where, "name", "missing", 'add name = "<topology name>" at the top')
    runner = _take(data, "runner", str, None, where, "")
    if not runner:
        raise _fail(where, "runner", "missing", 'add runner = "<CI runner label>", e.g. "ubuntu-latest"')
    backend = _take(data, "transfer_backend", str, "mooncake", where, "")
    if backend not in _TRANSFER_BACKENDS:
        raise _fail(
            where, "transfer_backend", f"unknown backend {backend!r}", f"use one of {', '.join(_TRANSFER_BACKENDS)}"
        )

    cluster = data.get("cluster")
    if not isinstance(cluster, dict):
        raise _fail(where, "cluster", "missing table", "add a [cluster] table with nodes and gpus_per_node")
    _check_unknown(cluster, _CLUSTER_KEYS, where, "cluster.")
    nodes = _positive(_take(cluster, "nodes", int, 1, where, "cluster."), where, "cluster.nodes")
    gpus_per_node = _positive(
        _take(cluster, "gpus_per_node", int, 0, where, "cluster."), where, "cluster.gpus_per_node", 0, MAX_GPUS_PER_NODE
    )
    gpu_model = _take(cluster, "gpu_model", str, None, where, "cluster.")
    gpu_mem = _take(cluster, "gpu_memory_gb", (int, float), None, where, "cluster.")
    if gpu_mem is not None:
        tomlcheck.number(
            TopologyError,
            gpu_mem,
            where,
            "cluster.gpu_memory_gb",
            1,
            MAX_GPU_MEMORY_GB,
            "set the memory of one GPU in GB, e.g. 80",
        )
    cpus_per_node = _take(cluster, "cpus_per_node", (int, float), None, where, "cluster.")
    if cpus_per_node is not None:
        tomlcheck.number(
            TopologyError,
            cpus_per_node,
            where,
            "cluster.cpus_per_node",
            0.001,
            MAX_CPUS_PER_NODE,
            "set the CPUs of one node, e.g. 16",
        )
    if gpus_per_node and not gpu_model:
        raise _fail(
            where, "cluster.gpu_model", "missing for a GPU cluster", 'add gpu_model = "H100" (or the model you need)'
        )
    if gpus_per_node and gpu_mem is None:
        raise _fail(
            where, "cluster.gpu_memory_gb", "missing for a GPU cluster", "add gpu_memory_gb = 80 (the memory per GPU)"
        )

    roles_table = data.get("roles")
    if not isinstance(roles_table, dict) or not roles_table:
        raise _fail(where, "roles", "missing", "add [roles.prefill] and [roles.decode] tables")
    roles = tuple(_parse_role(n, t, where) for n, t in roles_table.items())
    kinds = {r.kind for r in roles}
    for needed in ("prefill", "decode"):
        if needed not in kinds:
            raise _fail(where, f"roles.{needed}", "missing", f"add a [roles.{needed}] table (a PD topology needs both)")

    for r in roles:
        key = f"roles.{r.name}"
        if r.gpus_per_rank and not gpus_per_node:
            raise _fail(
                where,
                f"{key}.gpus_per_rank",
                f"asks for {r.gpus_per_rank} GPU(s) on a cluster without GPUs",
                "set gpus_per_rank = 0 or give [cluster] gpus_per_node",
            )
        if gpus_per_node and r.kind != "router" and not r.gpus_per_rank:
            raise _fail(
                where, f"{key}.gpus_per_rank", "is 0 on a GPU cluster", f"set {key}.gpus_per_rank = 1 (or more)"
            )
        if r.gpus_per_group and gpus_per_node % r.gpus_per_group:
            raise _fail(
                where,
                f"{key}.tp",
                f"tp × gpus_per_rank = {r.gpus_per_group} does not divide gpus_per_node = {gpus_per_node}",
                f"choose tp so that {gpus_per_node} is a multiple of tp × gpus_per_rank",
            )
        if r.node is not None and r.node >= nodes:
            raise _fail(
                where,
                f"{key}.node",
                f"node {r.node} does not exist (cluster has {nodes})",
                f"use a node index from 0 to {nodes - 1}",
            )

    kv_heads = _take(data, "kv_heads", int, None, where, "")
    if kv_heads is not None:
        _positive(kv_heads, where, "kv_heads")
        for r in roles:
            if r.kind != "router" and r.attn_tp % kv_heads and kv_heads % r.attn_tp:
                raise _fail(
                    where,
                    f"roles.{r.name}.tp",
                    f"attention TP {r.attn_tp} cannot be sliced to kv_heads = {kv_heads} (neither divides the other)",
                    f"pick a TP that divides {kv_heads} or is a multiple of it",
                )

    used = sum(r.total_gpus for r in roles)
    if used > nodes * gpus_per_node:
        detail = ", ".join(f"{r.name} {r.total_gpus}" for r in roles if r.total_gpus)
        raise _fail(
            where,
            "roles",
            f"GPUs do not add up: roles need {used} ({detail}) but the cluster has {nodes * gpus_per_node}",
            "lower count/tp/dp/gpus_per_rank or raise cluster.gpus_per_node / cluster.nodes",
        )
    for n in range(nodes):
        pinned = sum(r.total_gpus for r in roles if r.node == n)
        if pinned > gpus_per_node:
            raise _fail(
                where,
                "roles",
                f"roles pinned to node {n} need {pinned} GPUs but a node has {gpus_per_node}",
                "spread the roles over more nodes or lower their tp/count",
            )

    return Topology(
        name=name,
        runner=runner,
        nodes=nodes,
        gpus_per_node=gpus_per_node,
        roles=roles,
        description=_take(data, "description", str, "", where, ""),
        gpu_model=gpu_model,
        gpu_memory_gb=float(gpu_mem) if gpu_mem is not None else None,
        cpus_per_node=float(cpus_per_node) if cpus_per_node is not None else None,
        allow_simulation=_take(data, "allow_simulation", bool, True, where, ""),
        transfer_backend=backend,
        kv_heads=kv_heads,
    )


def load(path: str | Path) -> Topology:
    """Load and validate one topology file.

    Args:
        path: a ``.toml`` file.

    Returns:
        The validated :class:`Topology` (``path`` set).

    Raises:
        TopologyError: the file is missing, not TOML, or invalid.
    """
    p = Path(path)
    where = p.name
    data = tomlcheck.read(TopologyError, p, "topology", "harness topology list")
    topo = parse(data, where)
    if topo.name != p.stem:
        raise _fail(
            where, "name", f"{topo.name!r} differs from the file name", f'set name = "{p.stem}" or rename the file'
        )
    return Topology(**{**topo.__dict__, "path": p})


def names(directory: Path = TOPOLOGY_DIR) -> list[str]:
    """Names of the topology files in ``directory``, sorted."""
    return tomlcheck.names(directory)


def get(name_or_path: str | Path, directory: Path = TOPOLOGY_DIR) -> Topology:
    """Load a topology by name (``2-gpu-h100``) or by path.

    Raises:
        TopologyError: no such topology, or it is invalid.
    """
    return load(tomlcheck.find(TopologyError, "topology", name_or_path, directory))
