"""``harness topology list|show NAME|check NAME [--simulate] [--ray-address ADDR]``.

``check`` exits 0 when the cluster can hold the topology, 1 when it cannot (printing Ray's verdict,
INFEASIBLE or NO_RESOURCES, and the missing resource), 2 on bad input.
"""

from __future__ import annotations

import argparse
import json

from harness import topology
from harness.commands import UsageError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("topology", help="list, show and check topologies")
    tsub = p.add_subparsers(dest="action", metavar="ACTION")
    tsub.required = True
    tsub.add_parser("list", help="list the shipped topologies").set_defaults(func=_list)
    show = tsub.add_parser("show", help="print one topology as JSON")
    show.add_argument("name")
    show.set_defaults(func=_show)
    check = tsub.add_parser("check", help="say whether a Ray cluster can hold the topology (and what is missing)")
    check.add_argument("name")
    check.add_argument("--simulate", action="store_true", help="start a local Ray with the topology's GPUs as logical GPUs")
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
    print(json.dumps(_load(args.name).summary(), indent=2))
    return 0


def _check(args: argparse.Namespace) -> int:
    from harness.cluster import Cluster
    from harness.cluster.join import JoinError

    topo = _load(args.name)
    if args.simulate and args.ray_address:
        raise UsageError("--simulate starts a local cluster and --ray-address joins one: pass only one")
    if args.timeout <= 0:
        raise UsageError(f"--timeout must be > 0, got {args.timeout:g}")
    if args.ray_address:
        try:
            cluster = Cluster.join(args.ray_address, survey=False)  # only the fit is asked
        except JoinError as e:  # already one line: what failed and the fix
            raise UsageError(str(e)) from None
        except (ConnectionError, ValueError, RuntimeError) as e:
            raise UsageError(f"cannot join Ray at {args.ray_address} ({e}); check the address (host:port of the GCS)") from None
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
