"""``harness topology list|show NAME|check NAME``."""

from __future__ import annotations

import argparse
import json

from harness import topology
from harness.cli import UsageError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("topology", help="list, show and check topologies")
    tsub = p.add_subparsers(dest="action", metavar="ACTION")
    tsub.required = True
    tsub.add_parser("list", help="list the shipped topologies").set_defaults(func=_list)
    show = tsub.add_parser("show", help="print one topology as JSON")
    show.add_argument("name")
    show.set_defaults(func=_show)


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
