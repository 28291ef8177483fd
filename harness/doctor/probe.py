"""The probe: one Ray actor per topology bundle, placed exactly where a suite's worker would sit.

A probe only *reads* its node and *measures* the network; every judgement is made on the driver by pure
``check_*`` functions, and what it reads comes from injectable :class:`Sources`. The actor is threaded, so
a hung family blocks only its own call. Detail: docs/modules.md.
"""

from __future__ import annotations

import os
import socket
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from harness.doctor import gpu, host, network, software

#: Threads per probe actor: one per check family in flight plus the network calls.
MAX_CONCURRENCY = 8


@dataclass(frozen=True)
class Sources:
    """Where a probe reads its node from. Defaults read the real node.

    ``devices`` None means ``nvidia-smi`` when the node has it, else ``torch.cuda`` (decided on the
    node, not on the driver).
    """

    devices: gpu.DeviceSource | None = None
    versions: Callable[[], software.Versions] = software.installed_versions
    host: Callable[[str], host.HostFacts] = host.host_facts


@dataclass(frozen=True)
class ProbeInfo:
    """Who and where a probe is."""

    label: str
    node_id: str
    ip: str
    hostname: str
    pid: int
    gpu_ids: tuple[str, ...]
    log_path: str = ""


@dataclass(frozen=True)
class Target:
    """A decode probe as seen by a prefill probe: where to ping and where to write."""

    label: str
    node: str
    gpu: str
    host: str
    port: int
    mooncake_session: str | None = None
    mooncake_addr: int | None = None


class Probe:
    """The actor body (wrapped with ``ray.remote`` by the runner).

    Args:
        label: the bundle's name (``prefill-0.r1``).
        simulate: no real GPUs; mooncake over TCP.
        run_dir: where the run writes (the host check measures its disk).
        sources: what to read the node from.
        log_path: send this process's stdout and stderr there (the actor's own log file); None
            leaves them alone (a probe built in-process by a test).
    """

    def __init__(self, label: str, simulate: bool, run_dir: str, sources: Sources, log_path: str | None = None):
        self.label = label
        self.simulate = simulate
        self.run_dir = run_dir
        self.sources = sources
        self.log_path = self._redirect_output(Path(log_path)) if log_path else ""
        self._listener: network.Listener | None = None
        self._mooncake: network.MooncakeEndpoint | None = None
        self._mooncake_error: str | None = None
        self._lock = threading.Lock()

    @staticmethod
    def _redirect_output(path: Path) -> str:
        # mooncake and nvidia-smi talk on stderr from C++ threads; keep that in the probe's own log
        # file (the run directory layout's workers/) instead of the driver's terminal.
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        except OSError:
            return ""
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        return str(path)

    def info(self) -> ProbeInfo:
        import ray

        ctx = ray.get_runtime_context()
        return ProbeInfo(
            self.label,
            ctx.get_node_id(),
            ray.util.get_node_ip_address(),
            socket.gethostname(),
            os.getpid(),
            tuple(str(g) for g in ray.get_gpu_ids()),
            self.log_path,
        )

    def versions(self) -> software.Versions:
        return self.sources.versions()

    def gpus(self) -> gpu.GpuSnapshot:
        source = self.sources.devices or (gpu.SimulatedSource() if self.simulate else gpu.default_source())
        return source.snapshot()

    def host(self) -> host.HostFacts:
        return self.sources.host(self.run_dir)

    def ports(self, ports: list[tuple[str, int]]) -> list[tuple[str, int, str | None]]:
        return [(role, port, network.port_holder(port)) for role, port in ports]

    # ------------------------------------------------------------ network, decode side

    def listen(self) -> tuple[str, int]:
        """Open (once) the TCP listener on this node's IP and an OS-assigned port."""
        import ray

        with self._lock:
            if self._listener is None:
                self._listener = network.Listener(ray.util.get_node_ip_address())
            return self._listener.host, self._listener.port

    def _endpoint(self) -> network.MooncakeEndpoint | None:
        import ray

        with self._lock:
            if self._mooncake is None and self._mooncake_error is None:
                try:
                    self._mooncake = network.MooncakeEndpoint(ray.util.get_node_ip_address(), self.simulate)
                except ImportError as e:
                    self._mooncake_error = f"ImportError: {e}"
            return self._mooncake

    def mooncake_target(self, keys: list[str], nbytes: int) -> dict[str, Any]:
        """Register one receive buffer per key (one per prefill peer, so writes never overlap).

        Returns:
            ``{"session": id, "addrs": {key: addr}}``, or ``{"missing": why}`` without mooncake.
        """
        ep = self._endpoint()
        if ep is None:
            return {"missing": self._mooncake_error}
        return {
            "session": ep.session_id,
            "protocol": ep.protocol,
            "addrs": {k: ep.buffer(f"recv-{k}", nbytes) for k in keys},
        }

    def mooncake_digests(self, keys: list[str]) -> dict[str, str]:
        ep = self._endpoint()
        return {k: ep.digest(f"recv-{k}") for k in keys} if ep else {}

    # ------------------------------------------------------------ network, prefill side

    def measure(
        self, src_node: str, src_gpu: str, targets: list[Target], nbytes: int, pings: int, mooncake: bool
    ) -> list[network.PairResult]:
        """Ping, bulk-send and (for mooncake) transfer to each target in turn."""
        out = []
        for t in targets:
            r: dict[str, Any] = dict(
                src=self.label, dst=t.label, src_node=src_node, dst_node=t.node, src_gpu=src_gpu, dst_gpu=t.gpu
            )
            try:
                r["rtt"] = network.round_trip(t.host, t.port, pings)
            except OSError as e:
                r["rtt_error"] = f"TCP to {t.host}:{t.port} failed: {e}"
            try:
                r["tcp_bulk_s"] = network.bulk_send(t.host, t.port, nbytes)
            except OSError as e:
                r["tcp_bulk_error"] = f"{t.host}:{t.port}: {e}"
            if mooncake:
                r.update(self._mooncake_write(t, nbytes))
            out.append(network.PairResult(**r))
        return out

    def _mooncake_write(self, t: Target, nbytes: int) -> dict[str, Any]:
        ep = self._endpoint()
        if ep is None:
            return {"mooncake_missing": self._mooncake_error}
        if t.mooncake_session is None or t.mooncake_addr is None:
            return {"transfer_error": "the decode probe has no mooncake buffer", "transfer_protocol": ep.protocol}
        try:
            seconds, digest = ep.write(
                t.mooncake_session, t.mooncake_addr, nbytes, seed=f"{self.label}->{t.label}".encode()
            )
        except RuntimeError as e:
            return {"transfer_error": str(e), "transfer_protocol": ep.protocol}
        return {"transfer_s": seconds, "transfer_protocol": ep.protocol, "sent_digest": digest}

    def close(self) -> None:
        if self._listener is not None:
            self._listener.close()
        if self._mooncake is not None:
            self._mooncake.close()
