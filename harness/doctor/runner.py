"""The doctor's runner: place probes like a suite's workers, ask every family its question with a
deadline, and turn the answers into rows.

Every call goes through :func:`gather`: a call that has not answered by its deadline is reported ``hung``
and never waited on again, and every probe actor is killed at the end. The order of the run as steps:
docs/modules.md. Over 400 lines: one run's steps over one set of live probes.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Hashable

from harness.doctor import gpu, host, network, placement_check, software
from harness.doctor.gather import Outcome, gather
from harness.doctor.probe import MAX_CONCURRENCY, Probe, ProbeInfo, Sources, Target
from harness.doctor.result import CheckResult, Limits, Report, Status
from harness.rundir import RunDir
from harness.topology import Topology

if TYPE_CHECKING:
    from harness.cluster import Cluster

log = logging.getLogger(__name__)

_HUNG_FIX = (
    "the node or the probe is stuck: see the probe log, `ray status`, and `py-spy dump --pid PID` on that "
    "node; drain or reboot the node if it stays stuck"
)


@dataclass
class _Seat:
    """A live probe: its bundle and, once it answered, its info."""

    label: str
    role: str
    kind: str
    group: str
    rank: int
    handle: Any
    info: ProbeInfo | None = None
    node: str = "?"
    node_index: int | None = None

    @property
    def gpu(self) -> str:
        return ",".join(self.info.gpu_ids) if self.info and self.info.gpu_ids else "-"


def _bad_call(check: str, seat: _Seat, o: Outcome, what: str, timeout_s: float) -> CheckResult:
    where = (
        f"probe {seat.label} (pid {seat.info.pid}, log {seat.info.log_path or 'none'})"
        if seat.info
        else f"probe {seat.label}"
    )
    if o.hung:
        return CheckResult(
            check,
            Status.HUNG,
            f"{where} did not answer {what} within {timeout_s:g} s",
            _HUNG_FIX,
            node=seat.node,
            gpu=seat.gpu,
        )
    return CheckResult(
        check,
        Status.FAILED,
        f"{where}: {what} raised {o.error}",
        "read the probe log for the traceback; the probe ran the same code a worker would",
        node=seat.node,
        gpu=seat.gpu,
    )


def run(
    topology: Topology,
    *,
    simulate: bool = False,
    ray_address: str | None = None,
    run_dir: str | Path | None = None,
    limits: Limits = Limits(),
    ports: tuple[int, ...] = (),
    sources: Sources = Sources(),
    cluster: Cluster | None = None,
) -> Report:
    """Check a cluster against ``topology``.

    Args:
        topology: what the cluster must hold.
        simulate: logical GPUs on a CPU machine (GPU rows say ``simulated``).
        ray_address: join this cluster instead of starting a local one.
        run_dir: the run directory (host disk check; probe logs go to ``<run_dir>/workers/``);
            default ``runs/<timestamp>-<pid>`` (:func:`harness.rundir.default_path`).
        limits: thresholds and timeouts.
        ports: fixed ports to check on every node, besides those the engine args name.
        sources: what the probes read (tests inject fakes here).
        cluster: an already connected :class:`~harness.cluster.Cluster` (not shut down here).

    Returns:
        The :class:`Report`; ``report.exit_code`` is 0 only if every row passed or is simulated.

    Raises:
        RuntimeError: Ray could not be started or joined (the CLI turns it into one line).
    """
    from harness import rundir
    from harness.cluster import Cluster, PlacementError

    t0 = time.monotonic()
    run_dir = Path(run_dir) if run_dir is not None else rundir.default_path()
    owned = cluster is None
    if owned:
        cluster = Cluster.join(ray_address) if ray_address else Cluster.start(topology, simulate=simulate)
    desc = (
        (
            f"the Ray cluster at {ray_address}"
            if ray_address
            else "a local Ray with simulated GPUs"
            if simulate
            else "a local Ray"
        )
        if owned
        else f"the Ray cluster at {cluster.address}"
    )
    rows: list[CheckResult] = []
    seats: list[_Seat] = []
    placed = None
    before: dict[str, float] = {}
    try:
        before = _free()
        if simulate and not topology.allow_simulation:
            rows.append(placement_check.simulation_refused_row(topology))
            return _report(topology, simulate, rows, t0, desc)
        fit = cluster.check(topology, timeout=min(5.0, limits.start_timeout_s))
        rows.append(placement_check.fit_row(topology, fit.ok, fit.state, fit.group, fit.missing, desc))
        if not fit.ok:
            return _report(topology, simulate, rows, t0, desc)
        try:
            placed = cluster.place(topology, timeout=limits.start_timeout_s)
        except PlacementError as e:
            rows[-1] = placement_check.fit_row(topology, False, e.fit.state, e.fit.group, e.fit.missing, desc)
            return _report(topology, simulate, rows, t0, desc)
        seats = _start_probes(placed, simulate, str(run_dir), sources)
        rows += _identify(cluster, topology, seats, limits)
        alive = [s for s in seats if s.info is not None]
        rows += _read_nodes(topology, alive, simulate, limits, ports, tuple(getattr(cluster, "facts", ())))
        rows += _network(topology, alive, simulate, limits)
        return _report(topology, simulate, rows, t0, desc)
    finally:
        _stop(seats)
        if placed is not None:
            cluster.release(placed)
        if owned:
            cluster.shutdown()
        else:
            _await_release(before)


def _free() -> dict[str, float]:
    import ray

    free = ray.available_resources()
    return {k: free.get(k, 0.0) for k in ("CPU", "GPU")}


def _await_release(before: dict[str, float], timeout_s: float = 5.0) -> None:
    """Wait until the CPUs and GPUs free when the run began are free again.

    Ray returns a removed placement group's resources asynchronously (a few hundred ms here), for
    the fit check's trial groups as for the probes' groups; a caller that checks or places right
    after a doctor run on the same cluster would otherwise see NO_RESOURCES. On a shared cluster
    someone else may take them meanwhile: then give up after ``timeout_s`` with a warning.
    """
    from harness.clock import wait_for

    try:
        wait_for(
            lambda: all(_free()[k] + 1e-6 >= v for k, v in before.items()),
            timeout_s,
            "doctor probes' resources released",
        )
    except TimeoutError as e:
        log.warning("%s", e)


def _report(topology: Topology, simulate: bool, rows: list[CheckResult], t0: float, desc: str) -> Report:
    return Report(topology.name, simulate, tuple(rows), wall_s=time.monotonic() - t0, cluster=desc)


def _start_probes(placed: Any, simulate: bool, run_dir: str, sources: Sources) -> list[_Seat]:
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    actor = ray.remote(Probe)
    seats = []
    for g in placed.groups:
        for rank, bundle in enumerate(g.bundles):
            label = f"{g.name}.r{rank}"
            handle = actor.options(
                num_cpus=bundle.get("CPU", 0.1),
                num_gpus=bundle.get("GPU", 0),
                max_concurrency=MAX_CONCURRENCY,
                scheduling_strategy=PlacementGroupSchedulingStrategy(g.pg, placement_group_bundle_index=rank),
                name=None,
            ).remote(label, simulate, run_dir, sources, str(RunDir(Path(run_dir)).worker_log(f"doctor-{label}")))
            seats.append(_Seat(label, g.role, g.kind, g.name, rank, handle))
    return seats


def _stop(seats: list[_Seat]) -> None:
    import ray

    for s in seats:
        try:
            ray.kill(s.handle, no_restart=True)
        except Exception as e:  # already dead or Ray gone: nothing to stop
            log.debug("kill %s: %s", s.label, e)


def _node_label(ip: str, node_id: str, index: int | None) -> str:
    return f"node{index}/{ip}" if index is not None else f"{ip}/{node_id[:6]}"


def _identify(cluster: Cluster, topology: Topology, seats: list[_Seat], limits: Limits) -> list[CheckResult]:
    answers = gather({s.label: s.handle.info.remote() for s in seats}, limits.start_timeout_s)
    index = {n.node_id: n.index for n in cluster.nodes()}
    rows, found = [], []
    for s in seats:
        o = answers[s.label]
        if not o.ok:
            rows.append(_bad_call("placement.probe", s, o, "its first call (start-up)", limits.start_timeout_s))
            continue
        s.info = o.value
        s.node_index = index.get(s.info.node_id)
        s.node = _node_label(s.info.ip, s.info.node_id, s.node_index)
        found.append(placement_check.BundleSeat(s.role, s.group, s.rank, s.node, s.node_index, s.info.gpu_ids))
    return placement_check.seat_rows(topology, found) + rows


def _read_nodes(
    topology: Topology,
    seats: list[_Seat],
    simulate: bool,
    limits: Limits,
    extra_ports: tuple[int, ...],
    facts: tuple[Any, ...] = (),
) -> list[CheckResult]:
    """Software, host, GPU and fixed-port reads, all in flight together under one deadline.

    ``facts``: on a joined cluster, what every node answered when joined (:func:`harness.cluster.nodes.survey`):
    each node's versions against this machine's, and which nodes' GPUs are only logical.
    """
    first_on_node: dict[str, _Seat] = {}
    for s in seats:
        first_on_node.setdefault(s.node, s)
    gpu_seats = [s for s in seats if s.info.gpu_ids] if not simulate else []
    fixed = network.fixed_ports(topology)
    port_asks: dict[str, list[tuple[str, int]]] = {}
    for s in seats:
        for p in fixed.get(s.role, ()):
            if (s.role, p) not in port_asks.setdefault(s.node, []):
                port_asks[s.node].append((s.role, p))
    for node in first_on_node:
        port_asks.setdefault(node, []).extend(("--port option", p) for p in extra_ports)
    calls: dict[Hashable, Any] = {}
    for s in seats:
        calls[("versions", s.label)] = s.handle.versions.remote()
    for node, s in first_on_node.items():
        calls[("host", s.label)] = s.handle.host.remote()
        if port_asks.get(node):
            calls[("ports", s.label)] = s.handle.ports.remote(port_asks[node])
    for s in gpu_seats:
        calls[("gpus", s.label)] = s.handle.gpus.remote()
    answers = gather(calls, limits.check_timeout_s)

    rows: list[CheckResult] = []
    # software: one version set per node (probes on one node share the interpreter)
    per_node: dict[str, software.Versions] = {}
    for s in seats:
        o = answers[("versions", s.label)]
        if not o.ok:
            rows.append(_bad_call("software.probe", s, o, "the installed versions", limits.check_timeout_s))
            continue
        key = s.node if per_node.get(s.node, o.value) == o.value else f"{s.node} ({s.label})"
        per_node[key] = o.value
    rows += software.check_versions(per_node)
    if facts:
        rows += software.check_driver(list(facts))
    # host
    for node, s in first_on_node.items():
        o = answers[("host", s.label)]
        rows += (
            host.check_host(node, o.value, limits)
            if o.ok
            else [_bad_call("host.probe", s, o, "the host facts", limits.check_timeout_s)]
        )
    # fixed ports
    for node, s in first_on_node.items():
        if ("ports", s.label) not in answers:
            continue
        o = answers[("ports", s.label)]
        if not o.ok:
            rows.append(_bad_call("network.port", s, o, "the port check", limits.check_timeout_s))
            continue
        rows += [network.check_port(node, role, port, holder) for role, port, holder in o.value]
    logical = {f.node_id: f for f in facts if f.gpu_kind == "logical"}
    rows += _gpu_rows(topology, seats, gpu_seats, answers, simulate, limits, logical)
    return rows


def _gpu_rows(
    topology: Topology,
    seats: list[_Seat],
    gpu_seats: list[_Seat],
    answers: dict[Hashable, Outcome],
    simulate: bool,
    limits: Limits,
    logical: dict[str, Any] | None = None,
) -> list[CheckResult]:
    if not topology.needs_gpus:
        return [CheckResult("gpu.count", Status.PASSED, "the topology needs no GPUs", node="all")]
    if simulate:
        nodes = sorted({s.node for s in seats})
        rows = [
            CheckResult(
                "gpu.count",
                Status.SIMULATED,
                f"{topology.gpus_per_node} logical GPU(s) per node given to Ray; no real device queried",
                node=n,
            )
            for n in nodes
        ]
        for s in seats:
            if s.info.gpu_ids:
                rows += gpu.simulated_rows(s.node, list(s.info.gpu_ids))
        rows.append(CheckResult("gpu.driver", Status.SIMULATED, "no driver queried", node="all"))
        return rows
    rows = []
    own = frozenset(s.info.pid for s in seats)
    snaps: dict[str, gpu.GpuSnapshot] = {}
    logical = logical or {}
    for node_id in {s.info.node_id for s in gpu_seats if s.info.node_id in logical}:
        f = logical[node_id]
        rows.append(gpu.logical_row(next(s.node for s in gpu_seats if s.info.node_id == node_id), f.gpus, f.devices))
    for s in gpu_seats:
        if s.info.node_id in logical:  # nothing to look at: the row above says why
            continue
        o = answers[("gpus", s.label)]
        if not o.ok:
            rows.append(_bad_call("gpu.probe", s, o, "the GPU snapshot", limits.check_timeout_s))
            continue
        if s.node not in snaps:
            snaps[s.node] = o.value
            rows += gpu.check_node(topology, s.node, o.value)
        rows += gpu.check_bundle(topology, s.node, list(s.info.gpu_ids), o.value, limits, own)
    if snaps:
        rows += gpu.check_versions_equal(snaps)
    return rows


def _network(topology: Topology, seats: list[_Seat], simulate: bool, limits: Limits) -> list[CheckResult]:
    prefills = [s for s in seats if s.kind == "prefill"]
    decodes = [s for s in seats if s.kind == "decode"]
    mooncake = topology.transfer_backend == "mooncake"
    keys = [p.label for p in prefills]
    calls: dict[Hashable, Any] = {}
    for d in decodes:
        calls[("listen", d.label)] = d.handle.listen.remote()
        if mooncake:
            calls[("mooncake", d.label)] = d.handle.mooncake_target.remote(keys, limits.transfer_bytes)
    answers = gather(calls, limits.check_timeout_s)
    rows: list[CheckResult] = []
    targets: dict[str, list[Target]] = {p.label: [] for p in prefills}
    for d in decodes:
        lo = answers[("listen", d.label)]
        if not lo.ok:
            rows.append(
                _bad_call(
                    "network.probe", d, lo, "opening a TCP listener on an OS-assigned port", limits.check_timeout_s
                )
            )
            continue
        mo = answers.get(("mooncake", d.label), Outcome(value={}))
        if mooncake and not mo.ok:
            rows.append(
                _bad_call("network.probe", d, mo, "registering mooncake receive buffers", limits.check_timeout_s)
            )
        m = mo.value or {}
        for p in prefills:
            addr = (m.get("addrs") or {}).get(p.label)
            targets[p.label].append(Target(d.label, d.node, d.gpu, lo.value[0], lo.value[1], m.get("session"), addr))

    work = {
        p.label: p.handle.measure.remote(
            p.node, p.gpu, targets[p.label], limits.transfer_bytes, limits.rtt_pings, mooncake
        )
        for p in prefills
        if targets[p.label]
    }
    measured = gather(work, limits.check_timeout_s)
    pairs: list[network.PairResult] = []
    for p in prefills:
        if p.label not in measured:
            continue
        o = measured[p.label]
        if not o.ok:
            rows.append(
                _bad_call(
                    "network.probe", p, o, "the round trips and transfers to the decode probes", limits.check_timeout_s
                )
            )
            continue
        pairs += o.value
    if mooncake:
        pairs = _verify(decodes, pairs, keys, limits, rows)
    for pair in pairs:
        rows += network.check_pair(pair, topology.transfer_backend, limits.transfer_bytes)
    return rows


def _verify(
    decodes: list[_Seat], pairs: list[network.PairResult], keys: list[str], limits: Limits, rows: list[CheckResult]
) -> list[network.PairResult]:
    """Compare what each prefill probe sent with what its decode peer's buffer holds."""
    asks = {
        d.label: d.handle.mooncake_digests.remote(keys)
        for d in decodes
        if any(p.dst == d.label and p.sent_digest for p in pairs)
    }
    answers = gather(asks, limits.check_timeout_s)
    by_label = {d.label: d for d in decodes}
    for label, o in answers.items():
        if not o.ok:
            rows.append(
                _bad_call(
                    "network.probe", by_label[label], o, "the digests of its mooncake buffers", limits.check_timeout_s
                )
            )
    out = []
    for p in pairs:
        answer = answers.get(p.dst, Outcome(hung=True))
        if p.sent_digest is not None and answer.ok:
            p = dataclasses.replace(p, verified=answer.value.get(p.src) == p.sent_digest)
        out.append(p)
    return out
