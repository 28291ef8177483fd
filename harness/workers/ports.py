"""Ports for the processes the harness starts: free when chosen, and never handed out twice.

A server's port is chosen before the server binds it, so an outgoing connection or another harness process
can take it in between. So ports come from :func:`port_range` (above Ray's worker ports, below the
ephemeral range), are checked free, and are leased in a ledger every harness process on the machine shares
(:data:`LEASES`). Why and how: docs/modules.md.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import random
import socket
import time
from pathlib import Path
from typing import IO, Iterator

from harness.clock import Deadline
from harness.rundir import RunDir
from harness.workers import procs

#: Ray's default worker ports end here (``--max-worker-port``); ours start above.
RAY_MAX_WORKER_PORT = 19999
#: Below this many candidate ports, the OS picks instead (fewer would be found taken too often).
MIN_RANGE = 1000
#: A leased port is not handed out again for this long: the time a server may take to bind it.
LEASE_S = 900.0
#: The leases of the harness processes on this machine (``port expiry`` per line; one file per user, in the
#: user's own 0700 state directory, so no one else can plant it, link it elsewhere, or hold its lock).
LEASES = procs.STATE_DIR / "port-leases"
#: The longest a process waits for a lease ledger's lock (held for milliseconds by a healthy run).
LOCK_TIMEOUT_S = 30.0


class LeaseLockError(procs.StateError):
    """A lease ledger's lock stayed held past :data:`LOCK_TIMEOUT_S`: one line, naming the file."""


_TRIES = 1000
#: Not the module-level generator: tests seed that one (Hypothesis, workload seeds), and forked
#: children share its state, so two processes would try the same ports in the same order.
_RANDOM = random.SystemRandom()


def ephemeral_range(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> tuple[int, int]:
    """The kernel's range for ports it picks (``connect`` source ports, ``bind`` to 0)."""
    try:
        lo, hi = (int(x) for x in Path(path).read_text().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def port_range(ephemeral: tuple[int, int] | None = None) -> range | None:
    """Ports above Ray's worker ports and below the ephemeral range, or None when too few."""
    lo, _ = ephemeral or ephemeral_range()
    ports = range(RAY_MAX_WORKER_PORT + 1, lo)
    return ports if len(ports) >= MIN_RANGE else None


def is_free(port: int) -> bool:
    """Nothing is bound to ``port`` (TCP, any address), not even a socket in TIME_WAIT."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


@contextlib.contextmanager
def _locked(path: Path, timeout: float | None = None) -> Iterator[IO[str]]:
    """``path`` opened for update and locked, never through a symlink, within ``timeout`` (default
    :data:`LOCK_TIMEOUT_S`).

    Raises:
        LeaseLockError: the lock stayed held; or the path is a symlink.
    """
    if path == LEASES:
        procs.private_dir(path.parent)
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o600)
    except OSError as e:
        raise LeaseLockError(f"{path}: cannot be opened ({e.strerror}; a symlink is refused); remove it") from None
    with os.fdopen(fd, "a+") as f:
        bound = LOCK_TIMEOUT_S if timeout is None else timeout
        deadline = Deadline(bound)
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if deadline.expired():
                    raise LeaseLockError(
                        f"{path}: its lock was held by another process for {bound:g} s; "
                        "find it with `fuser -v` on the file, or remove the file"
                    ) from None
                deadline.sleep(0.02)
        f.seek(0)
        yield f


def _leased(f: IO[str], now: float) -> dict[int, float]:
    out = {}
    for line in f.read().splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0].isdigit():
            try:
                expiry = float(parts[1])
            except ValueError:
                continue
            if expiry > now:
                out[int(parts[0])] = expiry
    return out


def _os_port(taken: set[int], held: list[socket.socket]) -> int | None:
    for _ in range(_TRIES):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.bind(("", 0))
        held.append(s)  # kept bound so the OS gives a different one next time
        port = s.getsockname()[1]
        if port not in taken:
            return port
    return None


def allocate_ports(
    names: tuple[str, ...],
    run_dir: str | Path | None = None,
    *,
    leases: Path | None = None,
    lease_s: float = LEASE_S,
    ports: range | None = None,
) -> dict[str, int]:
    """One free TCP port per name: never one this run handed out, nor one any harness process on
    the machine leased in the last ``lease_s`` seconds.

    Args:
        names: what the ports are for (the keys of the result).
        run_dir: the run directory (its ``ports`` file lists every port the run handed out); None:
            only the machine's leases count.
        leases: the machine's lease ledger (default :data:`LEASES`).
        lease_s: how long a port handed out here stays leased.
        ports: where to choose (default :func:`port_range`; None there: the OS picks).

    Returns:
        name -> port.

    Raises:
        RuntimeError: no port left to hand out for a name.
    """
    if not names:
        return {}
    ports = ports if ports is not None else port_range()
    now = time.time()
    held: list[socket.socket] = []
    with contextlib.ExitStack() as stack:
        run = stack.enter_context(_locked(RunDir(Path(run_dir)).ports)) if run_dir is not None else None
        machine = stack.enter_context(_locked(leases or LEASES))
        used = {int(x) for x in run.read().split() if x.isdigit()} if run is not None else set()
        active = _leased(machine, now)
        taken = used | set(active)
        out: dict[str, int] = {}
        try:
            for name in names:
                port = None
                if ports is None:
                    port = _os_port(taken, held)
                else:
                    for _ in range(_TRIES):
                        p = _RANDOM.choice(ports)
                        if p not in taken and is_free(p):
                            port = p
                            break
                if port is None:
                    raise RuntimeError(f"no unused port found for {name!r}")
                taken.add(port)
                out[name] = port
        finally:
            for s in held:
                s.close()
        if run is not None:
            run.seek(0, os.SEEK_END)
            run.write("".join(f"{p}\n" for p in out.values()))
        active.update({p: now + lease_s for p in out.values()})
        machine.seek(0)
        machine.truncate()
        machine.write("".join(f"{p} {t:.3f}\n" for p, t in sorted(active.items())))
    return out
