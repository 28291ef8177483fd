"""``rerun-test --show-commands TOPOLOGY``: the server commands each role of the topology's PD stack
would run (:mod:`harness.engines.server.showcmd`), printed without starting anything."""

from __future__ import annotations

from typing import Sequence

from harness import topology
from harness.commands import UsageError


def text(names: Sequence[str]) -> str:
    """The commands of each named topology's PD stack, as shell lines.

    Raises:
        UsageError: no such topology, or its servers cannot be laid out (one line).
    """
    from harness.engines.server import showcmd
    from harness.engines.server.launcher import LaunchError

    out = []
    for name in names:
        try:
            topo = topology.get(name)
            out.append(showcmd.render(topo, showcmd.stack_commands(topo)))
        except (topology.TopologyError, LaunchError, KeyError) as e:
            raise UsageError(f"--show-commands {name}: {e}") from None
    return "\n".join(out)
