"""A real Ray cluster started with the ``ray`` CLI on this machine, for the joined-cluster tests.

The harness is tested against this cluster the way an engineer uses it against theirs: it did not
start it and reaches it through ``--ray-address`` only. Each node is one ``ray start --block``
process (the head first, then ``ray start --address``) in a session of its own, with its own temp
dir, log file, logical GPUs (``--num-gpus``), node label ``pd-harness/node=<i>`` (how an operator
tells the harness which topology node a Ray node is) and ports the OS picked. A small object store
and no dashboard keep it cheap.

Stopping kills exactly what was started: SIGTERM to the node's ``ray start`` (it stops its own
processes), a bounded wait, SIGKILL to every process left in the node's session, then a check that
none is left. Never ``ray stop``: it kills every Ray on the machine, other people's included.

API (Ray's ``cluster_utils.Cluster`` shape)::

    cluster = CliCluster(root, env={"RAY_AUTH_MODE": "disabled"})
    head = cluster.add_node(num_gpus=1)          # node 0 is the head
    worker = cluster.add_node(num_gpus=1)        # joins head's address
    cluster.address                              # "IP:PORT" for --ray-address
    cluster.kill_raylet(worker)                  # node loss: SIGKILL its raylet
    cluster.remove_node(worker)                  # stop it and verify nothing is left
    cluster.shutdown()                           # every node, workers first

    with two_nodes("pj-", env={"RAY_AUTH_MODE": "disabled"}) as cluster:   # a module's cluster
        ...
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from harness.workers import procs
from harness.workers.ports import allocate_ports
from harness.clock import wait_for

log = logging.getLogger(__name__)

RAY = str(Path(sys.executable).with_name("ray"))
#: The node label that names a Ray node's topology node index (read by ``harness.cluster``).
NODE_LABEL = "pd-harness/node"
START_TIMEOUT_S = 90.0  # a node registers in ~6 s alone; other engineers' runs share the 2 cores
STOP_GRACE_S = 10.0

_DEFAULTS = {"num_cpus": 2, "num_gpus": 1, "object_store_mb": 128}
# Every port a node listens on, besides the worker range: leased (harness.workers.ports), so no two clusters on
# the machine (nor the head and a worker here) collide on Ray's fixed defaults (10001, 52365, ...).
_NODE_PORTS = (
    "--node-manager-port",
    "--object-manager-port",
    "--dashboard-agent-listen-port",
    "--dashboard-agent-grpc-port",
    "--runtime-env-agent-port",
    "--metrics-export-port",
)
_HEAD_PORTS = ("--port", "--dashboard-port")


def free_ports(n: int) -> list[int]:
    """``n`` distinct TCP ports, free now and leased for this machine's harness processes
    (:mod:`harness.workers.ports`)."""
    return list(allocate_ports(tuple(f"p{i}" for i in range(n))).values())


@dataclass
class CliNode:
    """One ``ray start --block`` process and its session."""

    index: int
    proc: subprocess.Popen
    temp_dir: Path
    log_path: Path
    argv: list[str]
    env: dict[str, str] = field(repr=False)

    @property
    def sid(self) -> int:
        """The node's session id (the ``ray start`` pid: it was started as a session leader)."""
        return self.proc.pid

    def members(self) -> list[int]:
        """Every live process of this node."""
        return procs.session_members(self.sid)

    def pid_of(self, comm: str) -> int | None:
        """The pid of the node's process whose command name is ``comm`` (``raylet``, ``gcs_server``)."""
        for pid in self.members():
            try:
                if Path(f"/proc/{pid}/comm").read_text().strip() == comm:
                    return pid
            except OSError:
                continue
        return None

    def tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def started(self) -> bool:
        """True once ``ray start`` reported the node registered with the GCS; raises if it exited."""
        if self.proc.poll() is not None:
            raise RuntimeError(f"ray start of node {self.index} exited {self.proc.returncode}:\n{self.tail()}")
        return "Ray runtime started" in self.tail(200)


class CliCluster:
    """A Ray cluster of ``ray start`` nodes on this machine (see the module docstring).

    Args:
        root: a short directory for the nodes' temp dirs and logs (Ray puts AF_UNIX sockets there).
        env: extra environment of every node (auth variables, ``HOME``); a node's own wins.
    """

    def __init__(self, root: Path, env: dict[str, str] | None = None):
        self.root = Path(root)
        self.env = dict(env or {})
        self.nodes: list[CliNode] = []
        self.address: str | None = None
        self._count = 0

    def _node_env(self, extra: dict[str, str] | None) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "PYTEST_"))}
        env.update(RAY_DEDUP_LOGS="0", RAY_USAGE_STATS_ENABLED="0")
        env.pop("HARNESS_OWNER", None)  # the nodes belong to this fixture, not to a harness run
        env.update(self.env)
        env.update(extra or {})
        return env

    def add_node(
        self, *, env: dict[str, str] | None = None, wait: bool = True, index: int | None = None, **args: object
    ) -> CliNode:
        """Start one node: the head if none exists yet, else a worker joining the head.

        Args:
            env: this node's own extra environment (e.g. a PYTHONPATH that makes it differ).
            wait: wait until the node is registered with the GCS.
            index: its topology node index (label ``pd-harness/node``); default: the next one
                (a node that replaces a lost one takes the lost one's).
            args: ``num_cpus``, ``num_gpus``, ``object_store_mb``, ``labels`` (dict) over the defaults.

        Returns:
            The started node.

        Raises:
            RuntimeError: ``ray start`` exited or the node did not register in time (it is stopped).
        """
        opts = {**_DEFAULTS, **args}
        if index is None:
            index = self._count
        self._count = max(self._count, index + 1)
        head = self.address is None
        tdir = self.root / f"n{index}"
        tdir.mkdir(parents=True, exist_ok=True)
        names = (_HEAD_PORTS if head else ()) + _NODE_PORTS
        ports = dict(zip(names, free_ports(len(names))))
        labels = {NODE_LABEL: str(index), **dict(opts.get("labels") or {})}
        argv = [
            RAY,
            "start",
            "--block",
            "--disable-usage-stats",
            f"--temp-dir={tdir}",
            f"--num-cpus={opts['num_cpus']}",
            f"--num-gpus={opts['num_gpus']}",
            f"--object-store-memory={int(opts['object_store_mb']) << 20}",
            f"--labels={json.dumps(labels)}",
            *(f"{k}={v}" for k, v in ports.items()),
        ]
        argv += ["--head", "--include-dashboard=false"] if head else [f"--address={self.address}"]
        log_path = self.root / f"node{index}.log"
        with open(log_path, "ab") as out:  # a node that replaces a lost one appends to its log
            proc = subprocess.Popen(
                argv,
                env=self._node_env(env),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        node = CliNode(index, proc, tdir, log_path, argv, self._node_env(env))
        self.nodes.append(node)
        if head:
            self.address = f"{_node_ip()}:{ports['--port']}"
        if wait:
            try:
                wait_for(node.started, START_TIMEOUT_S, f"node {index} registered with the GCS")
            except BaseException:
                self.remove_node(node)
                if head:
                    self.address = None
                raise
        log.info("node %d up (pid %d, %s)", index, proc.pid, "head" if head else f"joined {self.address}")
        return node

    def kill_raylet(self, node: CliNode) -> int:
        """SIGKILL the node's raylet (what a lost machine looks like to the rest of the cluster).

        Returns:
            The raylet's pid.

        Raises:
            RuntimeError: the node has no running raylet.
        """
        pid = node.pid_of("raylet")
        if pid is None:
            raise RuntimeError(f"node {node.index} has no raylet running")
        os.kill(pid, signal.SIGKILL)
        return pid

    def remove_node(self, node: CliNode, grace: float = STOP_GRACE_S) -> None:
        """Stop ``node``: SIGTERM its ``ray start``, bounded wait, SIGKILL its session; verify it is empty.

        Raises:
            RuntimeError: a process of the node survived SIGKILL.
        """
        if node in self.nodes:
            self.nodes.remove(node)
        if node.proc.poll() is None:
            node.proc.send_signal(signal.SIGTERM)  # ray start --block stops its own processes on SIGTERM
        deadline = time.monotonic() + grace
        while node.members() and time.monotonic() < deadline:
            node.proc.poll()  # reap the leader
            time.sleep(0.1)
        for pid in node.members():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            node.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        left = procs.wait_gone(node.members(), 10.0)
        if left:
            raise RuntimeError(f"node {node.index}: processes {left} survived SIGKILL")
        shutil.rmtree(node.temp_dir, ignore_errors=True)

    def shutdown(self) -> None:
        """Stop every node, workers first (a head stopped first makes the workers wait on it)."""
        errors = []
        for node in sorted(self.nodes, key=lambda n: -n.index):
            try:
                self.remove_node(node)
            except RuntimeError as e:
                errors.append(str(e))
        self.address = None
        if errors:
            raise RuntimeError("; ".join(errors))


def _node_ip() -> str:
    """The IP ``ray start`` picks for this machine (its GCS listens there)."""
    from ray._private.services import get_node_ip_address

    return get_node_ip_address()


@contextmanager
def two_nodes(
    prefix: str,
    *,
    env: dict[str, str] | None = None,
    token: str | None = None,
    worker_env: dict[str, str] | None = None,
) -> Iterator[CliCluster]:
    """A head (topology node 0) and one worker node (node 1), one logical GPU each, under a fresh
    short temp dir (Ray's sockets live under it) with a home directory of their own; both stopped
    and the dir removed afterwards.

    Args:
        prefix: the temp dir's name prefix (short).
        env: extra environment of both nodes (``HOME`` is the cluster's own home dir).
        token: written to the home dir's ``.ray/auth_token`` (Ray then turns token auth on for a
            head whose ``RAY_AUTH_MODE`` is unset).
        worker_env: the worker node's own extra environment.
    """
    root = Path(tempfile.mkdtemp(prefix=prefix))
    home = root / "home"
    home.mkdir()
    if token is not None:
        (home / ".ray").mkdir()
        (home / ".ray" / "auth_token").write_text(token)
    cluster = CliCluster(root, env={"HOME": str(home), **(env or {})})
    try:
        cluster.add_node(num_gpus=1)
        cluster.add_node(num_gpus=1, env=worker_env)
        yield cluster
    finally:
        try:
            cluster.shutdown()
        finally:
            shutil.rmtree(root, ignore_errors=True)
