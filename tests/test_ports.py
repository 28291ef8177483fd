"""Ports for the servers the harness starts: outside the kernel's ephemeral range (where any outgoing
connection may take a released port) and above Ray's worker ports, free when chosen, and never handed
out twice: not by one run, nor by two harness processes at once (pytest-xdist workers, CI jobs)."""

from __future__ import annotations

import socket
from concurrent.futures import ThreadPoolExecutor

import pytest

from harness.workers import ports


def test_ports_sit_between_rays_worker_ports_and_the_ephemeral_range():
    assert ports.port_range((32768, 60999)) == range(20000, 32768)
    assert ports.port_range((1024, 65535)) is None  # too few left: the OS picks


def test_two_runs_at_once_never_get_the_same_port(tmp_path):
    leases = tmp_path / "leases"

    def run(i):
        got = []
        for _ in range(10):
            got += ports.allocate_ports(("http", "nccl", "bootstrap"), tmp_path / f"run{i}", leases=leases).values()
        return got

    with ThreadPoolExecutor(4) as pool:
        runs = list(pool.map(run, range(4)))
    every = [p for r in runs for p in r]
    assert len(every) == len(set(every)) == 120
    window = ports.port_range()
    if window is not None:
        assert all(p in window for p in every)
    # Each run's own file lists what it handed out.
    assert sorted(int(x) for x in (tmp_path / "run0" / "ports").read_text().split()) == sorted(runs[0])


def test_a_bound_port_is_skipped_and_a_lease_expires(tmp_path):
    # A port of the harness's range, so no outgoing connection takes it while the test runs.
    busy = ports.allocate_ports(("x",), tmp_path / "r0", leases=tmp_path / "other-leases")["x"]
    window = range(busy, busy + 1)
    with socket.socket() as s:
        s.bind(("", busy))
        s.listen()
        with pytest.raises(RuntimeError, match="no unused port found for 'a'"):
            ports.allocate_ports(("a",), tmp_path / "r1", leases=tmp_path / "leases", ports=window)
    free = ports.allocate_ports(("a",), tmp_path / "r1", leases=tmp_path / "leases", ports=window, lease_s=0)
    assert free == {"a": busy}
    # Expired for the machine, but this run handed it out already.
    with pytest.raises(RuntimeError, match="no unused port found for 'b'"):
        ports.allocate_ports(("b",), tmp_path / "r1", leases=tmp_path / "leases", ports=window)
    # Another run may take it once the lease is over.
    assert ports.allocate_ports(("b",), tmp_path / "r2", leases=tmp_path / "leases", ports=window) == {"b": busy}
    # ... and not while it is leased.
    with pytest.raises(RuntimeError, match="no unused port found for 'c'"):
        ports.allocate_ports(("c",), tmp_path / "r3", leases=tmp_path / "leases", ports=window)


def test_where_the_range_is_too_small_the_os_picks(tmp_path, monkeypatch):
    monkeypatch.setattr(ports, "port_range", lambda: None)
    got = ports.allocate_ports(("a", "b"), tmp_path, leases=tmp_path / "leases")
    assert len(set(got.values())) == 2


def test_a_held_lease_lock_fails_in_one_line_and_a_symlinked_ledger_is_refused(tmp_path, monkeypatch):
    # Before: an unbounded flock on a predictable file: anyone holding the lock hung every run.
    import fcntl

    leases = tmp_path / "leases"
    monkeypatch.setattr(ports, "LOCK_TIMEOUT_S", 0.3)
    with open(leases, "a") as holder:
        fcntl.flock(holder, fcntl.LOCK_EX)
        with pytest.raises(ports.LeaseLockError, match=r"leases: its lock was held by another process for 0.3 s; "):
            ports.allocate_ports(("a",), leases=leases)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_text("")
    link = tmp_path / "linked"
    link.symlink_to(elsewhere)
    with pytest.raises(ports.LeaseLockError, match="a symlink is refused"):
        ports.allocate_ports(("a",), leases=link)
    assert elsewhere.read_text() == ""
