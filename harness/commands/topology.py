"""``harness topology list|show NAME [--json]|check NAME [--simulate] [--ray-address ADDR]``.

``show`` prints the topology as a table (the cluster, then one row per role: instances, TP, DP,
attention-DP, GPUs, node and engine arguments); ``--json`` prints :meth:`Topology.summary` instead.

``check`` exits 0 when the cluster can hold the topology, 1 when it cannot (printing Ray's verdict,
INFEASIBLE or NO_RESOURCES, and the missing resource), 2 on bad input.
"""

from __future__ import annotations

import argparse
import json

from harness import topology
from harness.commands import UsageError, check_seconds


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("topology", help="list, show and check topologies")
    tsub = p.add_subparsers(dest="action", metavar="ACTION")
    tsub.required = True
    tsub.add_parser("list", help="list the shipped topologies").set_defaults(func=_list)
    show = tsub.add_parser("show", help="print one topology as a table (or JSON)")
    show.add_argument("name")
    show.add_argument("--json", action="store_true", help="print it as JSON")
    show.set_defaults(func=_show)
    check = tsub.add_parser("check", help="say whether a Ray cluster can hold the topology (and what is missing)")
    check.add_argument("name")
    check.add_argument(
        "--simulate", action="store_true", help="start a local Ray with the topology's GPUs as logical GPUs"
    )
    check.add_argument("--ray-address", metavar="ADDR", help="check against the running cluster at ADDR (host:port)")
    check.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for Ray's decision (default 5)")
    check.set_defaults(func=_check)


def _load(name: str) -> topology.Topology:
    try:
        return topology.get(name)
    except topology.TopologyError as e:
        raise UsageError(str(e)) from None


def _list(args: argparse.Namespace) -> int:
    for name in topology.names():
        t = _load(name)
        print(f"{t.name:22} {t.requirement:40} {t.description}")
    return 0


def _show(args: argparse.Namespace) -> int:
    topo = _load(args.name)
    if args.json:
        print(json.dumps(topo.summary(), indent=2, ensure_ascii=False))
    else:
        print(render(topo))
    return 0


def render(topo: topology.Topology) -> str:
    """The topology as text: a header, the cluster, and a table of its roles."""
    lines = [
        f"{topo.name}: {topo.description}" if topo.description else topo.name,
        f"  {topo.requirement} · transfer {topo.transfer_backend}"
        f" · {'may run simulated' if topo.allow_simulation else 'real GPUs only'}",
    ]
    if topo.gpu_memory_gb:
        lines[-1] += f" · {topo.gpu_memory_gb:g} GB per GPU"
    head = ("role", "kind", "count", "tp", "dp", "dp-attention", "GPUs/rank", "GPUs", "node", "engine args")
    rows = [head] + [
        (
            r.name,
            r.kind,
            str(r.count),
            str(r.tp),
            str(r.dp),
            "yes" if r.dp_attention else "no",
            str(r.gpus_per_rank),
            str(r.total_gpus),
            "any" if r.node is None else str(r.node),
            " ".join(r.engine_args) or "-",
        )
        for r in topo.roles
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    table = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    table.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines + [""] + table)


def _check(args: argparse.Namespace) -> int:
    from harness.cluster import Cluster
    from harness.cluster.join import JoinError

    topo = _load(args.name)
    if args.simulate and args.ray_address:
        raise UsageError("--simulate starts a local cluster and --ray-address joins one: pass only one")
    if args.timeout <= 0:
        raise UsageError(f"--timeout must be > 0, got {args.timeout:g}")
    check_seconds(args.timeout, "--timeout")
    if args.ray_address:
        try:
            cluster = Cluster.join(args.ray_address, survey=False)  # only the fit is asked
        except JoinError as e:  # already one line: what failed and the fix
            raise UsageError(str(e)) from None
        except (ConnectionError, ValueError, RuntimeError) as e:
            raise UsageError(
                f"cannot join Ray at {args.ray_address} ({e}); check the address (host:port of the GCS)"
            ) from None
        where = f"Ray at {args.ray_address}"
    else:
        cluster = Cluster.start(topo, simulate=args.simulate)
        where = "a local Ray with simulated GPUs" if args.simulate else "a local Ray on this machine"
    with cluster:
        fit = cluster.check(topo, timeout=args.timeout)
    print(f"{fit} [{where}]")
    if fit.ok:
        return 0
    print(f"hint: {topo.name} needs {topo.requirement}; run on that runner, or check with --simulate")
    return 1
