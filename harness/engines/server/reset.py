"""Resetting a started server between tests: sglang's own ``/flush_cache``, with the server's accounting
probe showing in its ledger that the flush found every pool back at baseline (the ``reset-leak``
rule) and that the decode books of every request since the start balance."""

from __future__ import annotations

import logging
from pathlib import Path

import requests

from harness import ledger
from harness.clock import Deadline
from harness.engines import phases
from harness.engines.server.http_client import ServerClient, ServerHTTPError
from harness.workers import Worker

log = logging.getLogger(__name__)
_POLL_S = 0.1  # between /flush_cache tries while the server is busy

#: Rules that judge what sglang decided (what admission charged, when decode evicted, how long a tail
#: prealloc kept) and say nothing about what the pools hold: a server whose reset found only these is
#: back at baseline and serves the next test. Any other rule (a leak, a double free, a slot neither free
#: nor cached) means its books cannot be trusted, and it is replaced.
JUDGEMENT_RULES = frozenset(
    {
        "reserve-short",
        "full-charge",
        "swa-charge",
        "host-charge",
        "alloc-after-admit",
        "swa-tail-long",
        "swa-tail-short",
        "swa-over-window",
        "swa-evict-late",
        "evicted-unaligned",
    }
)


class ResetError(RuntimeError):
    """A server could not be reset to baseline between tests: names the server and what was found.

    ``reusable``: the flush found every pool at baseline and the ledger only broke :data:`JUDGEMENT_RULES`.
    """

    def __init__(self, message: str, *, reusable: bool = False) -> None:
        super().__init__(message)
        self.reusable = reusable


def _resets(path: Path) -> list[ledger.Event]:
    return [e for e in ledger.read(path) if e.kind == "reset"] if path.exists() else []


def _early_releases(worker: Worker, path: Path, *, since: float, until: float) -> list[str]:
    """What the phase trace between two resets of ``worker`` shows let go too early: a deferred release
    before prefill's drain ack and its own timeout (``[release-before-ack]``), and a drain ack or a release
    while a chunk write of the room still ran (``[write-after-release]``); see :mod:`harness.engines.phases`."""
    from harness.engines.server.pd_stack import deferred_release_s

    marks = [m for m in phases.read_trace(path.parent) if since < m.t <= until]
    own = [m for m in marks if m.worker == worker.name]
    if not own:
        return []
    # The rooms this worker passed: another stack's servers (another model's, or a stack stopped before this
    # one started) write the same trace directory, and their findings are not this worker's.
    rooms = {m.room for m in own if m.room is not None}
    early = [f"[release-before-ack] {x}" for x in phases.early_releases(own, deferred_release_s(worker))]
    mine = [m for m in marks if m.room in rooms]
    return early + [f"[write-after-release] {x}" for x in phases.writes_after_release(mine)]


def reset_server(worker: Worker, ledger_path: str | Path, timeout_s: float = 30.0) -> ledger.Event:
    """Flush a server's caches through sglang's own ``/flush_cache`` and check it is back at baseline.

    sglang flushes only an idle server (it answers 400 while a request runs or waits), so the flush
    is retried until ``timeout_s``. The server's probe (started with a ledger) records the flush as
    a ``reset`` event: its pools' free-plus-cached sizes before and free sizes after. The whole
    ledger must then pass :func:`harness.ledger.check` (``reset-leak``: a slot neither free nor
    cached on an idle server; and the decode books of every request since the start); what it
    found already at the previous reset is not raised again.

    Args:
        worker: the server's :class:`harness.workers.Worker` (started with the probe).
        ledger_path: its ledger file (``<run_dir>/ledger/<worker name>.jsonl``).
        timeout_s: seconds to wait for the server to be idle and flushed.

    Returns:
        The ``reset`` event the flush wrote.

    Raises:
        WorkerDied: the server died meanwhile.
        ResetError: not idle in time, no ``reset`` event written (no probe?), or the ledger shows a leak.
    """
    path = Path(ledger_path)
    seen = len(_resets(path))
    client = ServerClient(worker.url("http"))
    deadline = Deadline(timeout_s)
    while True:
        worker.check()
        try:
            # The whole time left, not a shorter per-call bound: a loaded machine's scheduler can take
            # more than 10 s to answer a flush, and the answer is what the reset waits for.
            client.flush_cache(timeout_s=max(1.0, deadline.left()))
            break
        except requests.Timeout:
            raise ResetError(f"{worker.name}: /flush_cache did not answer within {timeout_s:g} s") from None
        except ServerHTTPError as e:
            if e.status != 400 or deadline.expired():
                raise ResetError(f"{worker.name}: /flush_cache did not succeed within {timeout_s:g} s: {e}") from None
        deadline.sleep(_POLL_S)
    resets = _resets(path)
    if len(resets) <= seen:
        raise ResetError(f"{worker.name}: the flush wrote no reset event to {path}; was it started with the probe?")
    events = ledger.read(path)
    # Only what broke since the previous reset: that reset's test was already told of what broke before.
    before = {str(v) for v in ledger.check([e for e in events if e.seq <= resets[seen - 1].seq])} if seen else set()
    # A request still in flight began after the flush (one holding pages across it is a page-leak): a
    # health probe or the next test's request, not what this reset judges.
    violations = [v for v in ledger.split_in_flight(ledger.check(events))[0] if str(v) not in before]
    if violations:
        raise ResetError(
            f"{worker.name}: ledger after the reset: " + "; ".join(map(str, violations[:5])),
            reusable=all(v.rule in JUDGEMENT_RULES for v in violations),
        )
    early = _early_releases(worker, path, since=resets[seen - 1].ts if seen else 0.0, until=resets[-1].ts)
    if early:
        raise ResetError(f"{worker.name}: " + "; ".join(early[:3]))
    log.debug("%s reset: %s", worker.name, resets[-1].free_after)
    return resets[-1]
