"""The command lines a topology's PD stack runs, shown without starting anything (``rerun-test --show-commands``).

The same :func:`.stack.pd_commands` the stack starts, with the GPUs and RDMA devices the process would get,
then the router's. No Ray, no process, no sglang import. What stays a placeholder: docs/modules.md.
"""

from __future__ import annotations

import math
import os
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from harness.engines.server import rdma
from harness.engines.server.launcher import SERVER_KINDS, Command, router_command
from harness.engines.server.layout import server_layout
from harness.engines.server.stack import pd_commands
from harness.topology import Topology

MODEL = "{model}"
RUN_DIR = "{run_dir}"


@dataclass(frozen=True)
class RoleCommand:
    """One process of the stack: its role, node and GPUs, and the command as the process gets it.

    ``command.env`` holds what the harness adds to the worker's environment (``CUDA_VISIBLE_DEVICES``
    included, as Ray sets it); ``command.argv`` is what sglang parses.
    """

    role: str
    node: int
    gpus: tuple[int, ...]
    command: Command

    def server_args(self) -> list[str]:
        """The arguments after ``python -m MODULE``."""
        argv = list(self.command.argv)
        return argv[argv.index("-m") + 2 :]


def planned_gpus(topology: Topology) -> dict[str, tuple[int, tuple[int, ...]]]:
    """``role -> (node, GPU indices)`` of each server bundle of the topology's layout on idle nodes.

    Bundles take GPUs in role order from GPU 0 of their node; two half-GPU bundles (a decode server
    and its plain baseline sharing one GPU) get the same GPU.
    """
    used: dict[int, float] = {}
    out: dict[str, tuple[int, tuple[int, ...]]] = {}
    for role in server_layout(topology).placement.roles:
        need = role.gpus_per_rank * role.tp * role.groups
        if not need:
            continue
        node = role.node or 0
        start = used.get(node, 0.0)
        used[node] = start + need
        out[role.name] = (node, tuple(range(math.floor(start), math.ceil(start + need))))
    return out


def stack_commands(
    topology: Topology,
    *,
    python: str | None = None,
    environ: Mapping[str, str] | None = None,
    sysfs: Path = rdma.IB_SYSFS,
) -> list[RoleCommand]:
    """Prefill, decode and router of ``topology`` as they would start (see the module docstring).

    Args:
        topology: a validated topology with prefill, decode and router roles.
        python: the servers' interpreter (default: this one, as the stack uses).
        environ: the environment the servers inherit (default ``os.environ``: ``HARNESS_IB_DEVICES``).
        sysfs: where this machine's RDMA devices are read.

    Returns:
        One :class:`RoleCommand` per process, prefill first, router last.

    Raises:
        harness.engines.server.launcher.LaunchError: a server does not fit one node.
    """
    layout = server_layout(topology)
    gpus = planned_gpus(topology)
    env_in = dict(os.environ if environ is None else environ)
    cmds = pd_commands(topology, MODEL, RUN_DIR, extra_args={k: layout.args_of(k) for k in SERVER_KINDS})
    out = []
    for kind, cmd in zip(SERVER_KINDS, cmds):
        node, ids = gpus.get(kind, (0, ()))
        env = dict(cmd.env)
        if ids:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, ids))
        argv = list(cmd.argv)
        if python is not None:
            argv[0] = python
        head = argv.index("-m") + 2
        argv[head:] = rdma.complete_argv(argv[head:], {**env_in, **env}, sysfs)
        out.append(RoleCommand(kind, node, ids, Command(cmd.role, tuple(argv), env, cmd.pythonpath)))
    router = router_command(
        topology,
        prefill=[("http://{prefill.host}:{prefill.http}", "{prefill.bootstrap}")],
        decode=["http://{decode.host}:{decode.http}"],
        port="{http}",
        prometheus_port="{prometheus}",
    )
    if python is not None:
        router = Command(router.role, (python, *router.argv[1:]), router.env, router.pythonpath)
    out.append(RoleCommand("router", 0, (), router))
    return out


def _lines(rc: RoleCommand) -> list[str]:
    cmd = rc.command
    env = dict(cmd.env)
    if cmd.pythonpath:
        env["PYTHONPATH"] = os.pathsep.join([*cmd.pythonpath, "$PYTHONPATH"])
    parts = [f"{k}={shlex.quote(v) if k != 'PYTHONPATH' else v}" for k, v in sorted(env.items())]
    argv = list(cmd.argv)
    head = argv.index("-m") + 2
    parts.append(shlex.join(argv[:head]))
    args = argv[head:]
    i = 0
    while i < len(args):
        j = i + 1
        while j < len(args) and not args[j].startswith("--"):
            j += 1
        parts.append(shlex.join(args[i:j]))
        i = j
    return [p + " \\" for p in parts[:-1]] + [parts[-1]]


def render(topology: Topology, commands: list[RoleCommand]) -> str:
    """The commands as shell lines, each process under a comment naming its role, node and GPUs."""
    out = [
        f"# {topology.name}: {topology.description}",
        "# {model}, {run_dir} and the ports in braces are filled when the stack starts (ports leased from the OS)",
    ]
    for rc in commands:
        where = f"node {rc.node}, GPUs {','.join(map(str, rc.gpus))}" if rc.gpus else "no GPU"
        out += ["", f"# {rc.role} ({where})"]
        if rdma.NODE_GPUS_ENV in rc.command.env and rdma.FLAG not in rc.command.argv:
            out.append(
                f"# no RDMA device found here (/sys/class/infiniband, {rdma.DEVICES_ENV}): "
                f"no {rdma.FLAG}, mooncake chooses"
            )
        if rc.role == "router":
            out.append(
                "# the harness starts it beside the servers without --prefill/--decode and registers each "
                "server (POST /workers) once it is ready: the same router, without its start-up retries"
            )
        out += _lines(rc)
    return "\n".join(out) + "\n"
