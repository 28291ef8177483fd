"""Network checks between every prefill bundle and every decode bundle.

``network.tcp_rtt``, ``network.transfer`` (through the topology's transfer backend, mooncake's own engine
when it is mooncake) and ``network.port``, each measured inside the probe actors; the probe side does the
I/O and the ``check_*`` functions are pure. Each measurement: docs/modules.md. Over 400 lines: three checks,
each a probe half and a pure half.
"""

from __future__ import annotations

import errno
import hashlib
import os
import socket
import socketserver
import statistics
import struct
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from harness.doctor.result import CheckResult, Status
from harness.topology import Topology

MOONCAKE_INSTALL_HINT = (
    "install mooncake's transfer engine on every node: `apt-get install libibverbs1` and "
    "`pip install --no-deps mooncake-transfer-engine-non-cuda==0.3.13.post1` "
    "(mooncake-transfer-engine on GPU nodes)"
)
_IO_TIMEOUT_S = 10.0
_CHUNK = 1 << 20


# --------------------------------------------------------------------------------------------
# probe side: TCP
# --------------------------------------------------------------------------------------------


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), _CHUNK))
        if not chunk:
            raise ConnectionError(f"peer closed after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


class _Handler(socketserver.BaseRequestHandler):
    # One connection: b"P" is echoed; b"S" + 8-byte length is drained and the count sent back.
    def handle(self) -> None:
        sock: socket.socket = self.request
        sock.settimeout(_IO_TIMEOUT_S)
        try:
            while op := sock.recv(1):
                if op == b"P":
                    sock.sendall(b"P")
                elif op == b"S":
                    (n,) = struct.unpack("!Q", _recv_exact(sock, 8))
                    got = 0
                    while got < n:
                        chunk = sock.recv(min(n - got, _CHUNK))
                        if not chunk:
                            break
                        got += len(chunk)
                    sock.sendall(struct.pack("!Q", got))
                else:
                    return
        except OSError:
            return


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = False


class Listener:
    """A TCP echo-and-sink server on ``host`` and a port the OS assigns, served from a daemon thread."""

    def __init__(self, host: str):
        self._server = _Server((host, 0), _Handler)
        self.host, self.port = self._server.server_address[:2]
        self._thread = threading.Thread(target=self._server.serve_forever, name="doctor-listener", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


@dataclass(frozen=True)
class RoundTrip:
    min_ms: float
    median_ms: float
    pings: int


def round_trip(host: str, port: int, pings: int, timeout_s: float = _IO_TIMEOUT_S) -> RoundTrip:
    """Connect to a :class:`Listener` and time ``pings`` one-byte round trips.

    Raises:
        OSError: connection refused, reset or timed out.
    """
    with socket.create_connection((host, port), timeout=timeout_s) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        times = []
        for _ in range(max(1, pings)):
            t0 = time.perf_counter()
            s.sendall(b"P")
            _recv_exact(s, 1)
            times.append((time.perf_counter() - t0) * 1e3)
    return RoundTrip(min(times), statistics.median(times), len(times))


def bulk_send(host: str, port: int, nbytes: int, timeout_s: float = _IO_TIMEOUT_S) -> float:
    """Send ``nbytes`` to a :class:`Listener` over a plain TCP socket; return seconds until acknowledged.

    Raises:
        OSError: the connection failed; ConnectionError: the listener got fewer bytes.
    """
    payload = os.urandom(min(nbytes, _CHUNK))
    with socket.create_connection((host, port), timeout=timeout_s) as s:
        t0 = time.perf_counter()
        s.sendall(b"S" + struct.pack("!Q", nbytes))
        sent = 0
        while sent < nbytes:
            part = payload[: nbytes - sent]
            s.sendall(part)
            sent += len(part)
        (got,) = struct.unpack("!Q", _recv_exact(s, 8))
        seconds = time.perf_counter() - t0
    if got != nbytes:
        raise ConnectionError(f"listener received {got} of {nbytes} bytes")
    return seconds


# --------------------------------------------------------------------------------------------
# probe side: mooncake
# --------------------------------------------------------------------------------------------


def mooncake_protocol(simulate: bool) -> tuple[str, str]:
    """The (protocol, device) mooncake should use on this node.

    ``MOONCAKE_PROTOCOL`` / ``MOONCAKE_DEVICE`` win; else RDMA when the node has InfiniBand devices
    and this is not a simulation, else TCP.
    """
    proto = os.environ.get("MOONCAKE_PROTOCOL")
    if not proto:
        ib = Path("/sys/class/infiniband")
        proto = "rdma" if (not simulate and ib.is_dir() and any(ib.iterdir())) else "tcp"
    return proto, os.environ.get("MOONCAKE_DEVICE", "")


class MooncakeEndpoint:
    """One mooncake ``TransferEngine`` in a probe, with registered buffers to write from or into.

    Raises:
        ImportError: mooncake is not installed (the caller reports the install hint).
        RuntimeError: the engine did not initialise or a buffer could not be allocated.
    """

    def __init__(self, host: str, simulate: bool):
        self.protocol, device = mooncake_protocol(simulate)
        if self.protocol == "tcp":
            os.environ["MC_FORCE_TCP"] = "1"  # mooncake installs its TCP transport only with this set
        from mooncake.engine import TransferEngine

        self._engine = TransferEngine()
        ret = self._engine.initialize(host, "P2PHANDSHAKE", self.protocol, device)
        if ret != 0:
            raise RuntimeError(
                f"mooncake TransferEngine.initialize({host!r}, P2PHANDSHAKE, {self.protocol!r}) returned {ret}"
            )
        self.session_id = f"{host}:{self._engine.get_rpc_port()}"
        self._buffers: dict[str, tuple[int, int]] = {}

    def buffer(self, key: str, nbytes: int) -> int:
        """A registered buffer of ``nbytes`` named ``key`` (allocated once); its address."""
        if key not in self._buffers:
            addr = self._engine.allocate_managed_buffer(nbytes)
            if not addr:
                raise RuntimeError(f"mooncake could not allocate {nbytes} bytes")
            self._buffers[key] = (addr, nbytes)
        return self._buffers[key][0]

    def write(self, session_id: str, remote_addr: int, nbytes: int, seed: bytes) -> tuple[float, str]:
        """Write ``nbytes`` derived from ``seed`` into a peer's buffer.

        Returns:
            (seconds, sha256 of what was sent).

        Raises:
            RuntimeError: the transfer failed.
        """
        data = _pattern(seed, nbytes)
        local = self.buffer(f"send-{nbytes}", nbytes)
        self._engine.write_bytes_to_buffer(local, data, nbytes)
        t0 = time.perf_counter()
        ret = self._engine.transfer_sync_write(session_id, local, remote_addr, nbytes)
        seconds = time.perf_counter() - t0
        if ret < 0:
            raise RuntimeError(f"mooncake transfer_sync_write to {session_id} returned {ret}")
        return seconds, hashlib.sha256(data).hexdigest()

    def digest(self, key: str) -> str:
        """sha256 of the named buffer's content."""
        addr, n = self._buffers[key]
        return hashlib.sha256(self._engine.read_bytes_from_buffer(addr, n)).hexdigest()

    def close(self) -> None:
        for addr, _ in self._buffers.values():
            try:
                self._engine.free_managed_buffer(addr, 0)
            except Exception:  # the engine may already be torn down; the process exits next
                pass
        self._buffers.clear()


def _pattern(seed: bytes, nbytes: int) -> bytes:
    block = hashlib.sha256(seed).digest() * (_CHUNK // 32)
    return (block * (nbytes // len(block) + 1))[:nbytes]


# --------------------------------------------------------------------------------------------
# probe side: fixed ports
# --------------------------------------------------------------------------------------------


def port_holder(port: int, host: str = "0.0.0.0") -> str | None:
    """Whether ``port`` can be bound on this node.

    Returns:
        None when the port is free, else who holds it (``pid N: command`` when visible).
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
            return None
        except OSError as e:
            if e.errno != errno.EADDRINUSE:
                return f"cannot bind: {e.strerror}"
    return _who_listens(port) or "in use (holder not visible to this user)"


def _who_listens(port: int) -> str | None:
    try:
        import psutil
    except ImportError:
        return None
    try:
        conns = psutil.net_connections(kind="tcp")
    except (psutil.AccessDenied, OSError):
        return None
    for c in conns:
        if c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN and c.pid:
            try:
                cmd = " ".join(psutil.Process(c.pid).cmdline())[:160]
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                cmd = "?"
            return f"pid {c.pid}: {cmd}"
    return None


def fixed_ports(topology: Topology) -> dict[str, tuple[int, ...]]:
    """Ports the topology's engine args pin (``--port 30000``, ``--disaggregation-bootstrap-port=8998``).

    Returns:
        role name -> ports (roles without fixed ports left out).
    """
    out: dict[str, tuple[int, ...]] = {}
    for role in topology.roles:
        ports, args = [], list(role.engine_args)
        for i, a in enumerate(args):
            flag, _, value = a.partition("=")
            if not (flag.startswith("--") and flag.endswith("port")):
                continue
            if not value and i + 1 < len(args):
                value = args[i + 1]
            if value.isdigit():
                ports.append(int(value))
        if ports:
            out[role.name] = tuple(ports)
    return out


# --------------------------------------------------------------------------------------------
# checks (pure)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PairResult:
    """What one prefill probe measured towards one decode probe (``error`` set when it failed)."""

    src: str
    dst: str
    src_node: str
    dst_node: str
    src_gpu: str = "-"
    dst_gpu: str = "-"
    rtt: RoundTrip | None = None
    rtt_error: str | None = None
    tcp_bulk_s: float | None = None
    tcp_bulk_error: str | None = None
    transfer_s: float | None = None
    transfer_error: str | None = None
    transfer_protocol: str = ""
    verified: bool | None = None  # set by the runner: the receiver's digest equals sent_digest
    sent_digest: str | None = None
    mooncake_missing: str | None = None  # the ImportError text when mooncake is not importable


def _mbps(nbytes: int, seconds: float) -> str:
    return f"{nbytes / max(seconds, 1e-9) / 1e6:.0f} MB/s"


def check_pair(pair: PairResult, backend: str, nbytes: int) -> list[CheckResult]:
    """Rows for one prefill → decode pair.

    Args:
        pair: the measurements.
        backend: the topology's transfer backend.
        nbytes: bytes moved by the transfer self-test.

    Returns:
        ``network.tcp_rtt`` and ``network.transfer`` rows.
    """
    where = pair.src_node if pair.src_node == pair.dst_node else f"{pair.src_node}→{pair.dst_node}"
    who = f"{pair.src} → {pair.dst}"
    gpus = "-" if pair.src_gpu == pair.dst_gpu == "-" else f"{pair.src_gpu}→{pair.dst_gpu}"
    rows = []
    if pair.rtt is not None:
        rows.append(
            CheckResult(
                "network.tcp_rtt",
                Status.PASSED,
                f"{who}: min {pair.rtt.min_ms:.2f} ms, median {pair.rtt.median_ms:.2f} ms over {pair.rtt.pings} pings",
                node=where,
                gpu=gpus,
            )
        )
    else:
        rows.append(
            CheckResult(
                "network.tcp_rtt",
                Status.FAILED,
                f"{who}: {pair.rtt_error}",
                "open TCP between the nodes on ephemeral ports (firewall/security group: allow the "
                "ip_local_port_range between cluster nodes) and check the node IPs Ray reports",
                node=where,
                gpu=gpus,
            )
        )
    mib = f"{nbytes / (1 << 20):g} MiB"
    bulk = (
        f"plain TCP socket bulk transfer (not the transfer backend): {mib} at {_mbps(nbytes, pair.tcp_bulk_s)}"
        if pair.tcp_bulk_s is not None
        else f"plain TCP socket bulk transfer failed: {pair.tcp_bulk_error}"
    )
    if backend == "mooncake":
        if pair.mooncake_missing is not None:
            rows.append(
                CheckResult(
                    "network.transfer",
                    Status.FAILED,
                    f"{who}: mooncake not importable ({pair.mooncake_missing}); {bulk}",
                    MOONCAKE_INSTALL_HINT,
                    node=where,
                    gpu=gpus,
                )
            )
        elif pair.transfer_s is not None and pair.verified:
            rows.append(
                CheckResult(
                    "network.transfer",
                    Status.PASSED,
                    f"{who}: mooncake {pair.transfer_protocol}: {mib} at {_mbps(nbytes, pair.transfer_s)}, "
                    "content verified",
                    node=where,
                    gpu=gpus,
                )
            )
        else:
            problem = pair.transfer_error or (
                "content differs at the receiver"
                if pair.verified is False
                else "sent, but the receiver could not be asked for its buffer's digest"
            )
            rows.append(
                CheckResult(
                    "network.transfer",
                    Status.FAILED,
                    f"{who}: mooncake {pair.transfer_protocol or '?'}: {problem}; {bulk}",
                    "check mooncake can reach the peer: MC_FORCE_TCP=1 for TCP, or the RDMA device "
                    "(MOONCAKE_DEVICE, RoCE GID index) on both nodes; the transfer engine logs are in the probe log",
                    node=where,
                    gpu=gpus,
                )
            )
        return rows
    if pair.tcp_bulk_s is not None:
        rows.append(
            CheckResult(
                "network.transfer",
                Status.PASSED,
                f"{who}: no {backend} self-test in doctor; {bulk}",
                node=where,
                gpu=gpus,
            )
        )
    else:
        rows.append(
            CheckResult(
                "network.transfer",
                Status.FAILED,
                f"{who}: {bulk}",
                "open TCP between the nodes on ephemeral ports",
                node=where,
                gpu=gpus,
            )
        )
    return rows


def check_port(node: str, role: str, port: int, holder: str | None) -> CheckResult:
    """The ``network.port`` row of one fixed port on one node (``holder`` from :func:`port_holder`)."""
    if holder is None:
        return CheckResult("network.port", Status.PASSED, f"port {port} ({role}) is free", node=node)
    return CheckResult(
        "network.port",
        Status.FAILED,
        f"port {port} ({role}) is taken: {holder}",
        f"stop that process, or drop the fixed port from {role}'s engine_args so the harness "
        "asks the OS for a free one",
        node=node,
    )
