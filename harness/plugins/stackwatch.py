"""pytest plugin concern: the watcher beside each real-server test, which ends the requests a PD stack can
no longer answer, so that their clients return now (not after their own timeouts) and the failure's first
line names the cause. Own code: it reads the harness's own phase trace and the watchdog's deaths.

Three causes, each acted on from the trace (:class:`harness.engines.phases.TraceTail`) or the watchdog:

1. sglang's lost status update (the probe's ``transfer.lost-update`` mark): that request is aborted on both
   servers at once (the race: :data:`harness.plugins.explain.KNOWN_RACES`);
2. a stack's server died (the watchdog's report, which fails the test through fail-fast): every request on
   the stack's surviving servers is aborted. A client blocked on the dead one (prefill waits out its 300 s
   bootstrap timeout for a dead decode) would hold the test, and any thread pool it runs in, that long: a
   fault check's run lost 310 s to one such wait;
3. a stall: a PD request (one decode preallocated during the test) that has not reached decode's commit makes
   no progress, no phase mark on either side, for the test's stall bound (:data:`STALL_S`, or
   ``stall_bound(S)``), and no hold is set. It is aborted on both servers and recorded with where each side was
   (:func:`harness.engines.phases.stall_story`); the failure's headline leads with it
   (:func:`stalls`). The bound comes before the client's own (120 s), so the evidence is still there.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from harness.engines.server.stack_pool import StackPool

log = logging.getLogger(__name__)

#: Seconds a PD request may go without a phase mark before decode commits it (the harness's bound, before
#: the client's 120 s). In a fresh clone's CI run on the 2-core machine, the longest gap between two marks
#: of any of the 327 PD requests that reached decode's commit was 0.60 s (a request waiting in decode's
#: prealloc queue for pages: 0.54 s); a test that waits on purpose sets a hold.
STALL_S = 60.0
#: The bootstrap room of sglang's warm-up and health requests (``/health_generate``'s fake bootstrap).
FAKE_ROOM = 0
#: Phases after which a request is past the PD handshake and transfer (decoding has no marks).
_PAST_PD = frozenset({"decode.commit", "decode.defer", "decode.release", "decode.released"})


@dataclass(frozen=True)
class Stall:
    """A request the watcher aborted for making no progress: its id, the seconds it went without a mark,
    and where each side was (:func:`harness.engines.phases.stall_story`)."""

    rid: str
    idle_s: float
    story: str

    def line(self) -> str:
        return f"stall: request {self.rid}: {self.story} (no progress for {self.idle_s:.0f} s: the harness aborted it)"


#: The stalls the watcher aborted during a test (read by the failure's headline).
stalls_key = pytest.StashKey[list[Stall]]()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"stall_bound(seconds): abort a PD request of this test that goes this long without progress "
        f"before decode commits it, and lead its failure with where each side was (default {STALL_S:g})",
    )


def stalls(item: pytest.Item) -> list[Stall]:
    """The stalls the watcher aborted during ``item``."""
    return item.stash.get(stalls_key, [])


class StackWatcher:
    """The watcher of one test (see the module docstring); :meth:`stop` at the test's end."""

    POLL_S = 0.5

    def __init__(self, stacks: StackPool, deaths: list, item: pytest.Item | None = None) -> None:
        from harness.engines import phases

        self._stacks = stacks
        self._deaths, self._seen = deaths, len(deaths)
        self._item = item
        marker = item.get_closest_marker("stall_bound") if item is not None else None
        self.bound_s = float(marker.args[0]) if marker is not None else STALL_S
        self.stalls: list[Stall] = []
        if item is not None:
            item.stash[stalls_key] = self.stalls
        self._marks: list[Any] = []
        self._last: dict[str, float] = {}  # PD request -> its latest mark
        self._first: dict[str, float] = {}
        self._past: set[str] = set()  # past decode's commit, or aborted here
        self._unclaimed: dict[int, list[Any]] = {}  # room -> its marks seen before one named its request
        # Requests decode preallocated during this test: a request of an earlier test whose last marks come
        # late (a drain ack after its release, on a loaded machine) is not this test's stall.
        self._born: set[str] = set()
        self._done = threading.Event()
        #: Rounds the watcher has begun (a caller proves rounds went by without sleeping).
        self.rounds = 0
        ledger = stacks.run_dir.ledger if stacks.run_dir is not None else None
        self._tail = phases.TraceTail(ledger) if ledger is not None else None
        self._holds = phases.hold_dir(ledger) if ledger is not None else None
        if self._tail is not None:
            self._tail.new()  # what came before the test is not its business
        self._thread = threading.Thread(target=self._run, name="stack-watcher", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._done.wait(self.POLL_S):
            self.rounds += 1
            try:
                self._on_deaths()
                tail = self._tail
                if tail is None:
                    continue
                for mark in tail.new():
                    self._note(mark, tail.rid_of_room)
                self._on_stalls(time.time())
            except Exception as e:  # noqa: BLE001 - a watcher must never fail the test it watches
                log.warning("stack watcher: %r", e)

    def _note(self, mark: Any, rid_of_room: dict[int, str]) -> None:
        if mark.room == FAKE_ROOM:
            return  # a warm-up or health request on sglang's fake bootstrap: no transfer to stall
        self._marks.append(mark)
        rid = mark.rid or (rid_of_room.get(mark.room, "") if mark.room is not None else "")
        if mark.phase == "transfer.lost-update" and mark.room is not None:
            self._abort(rid, f"room {mark.room} lost its status update in sglang")
            self._past.add(rid)
        if mark.room is not None and not rid:
            self._unclaimed.setdefault(mark.room, []).append(mark)  # its request is named by a later mark
            return
        if not rid or mark.room is None and rid not in self._last:
            return  # a plain server's request
        for early in self._unclaimed.pop(mark.room, []) if mark.room is not None else ():
            self._progress(rid, early)
        self._progress(rid, mark)

    def _progress(self, rid: str, mark: Any) -> None:
        self._first[rid] = min(self._first.get(rid, mark.t), mark.t)
        self._last[rid] = max(self._last.get(rid, 0.0), mark.t)
        if mark.phase == "decode.prealloc":
            self._born.add(rid)
        if mark.phase in _PAST_PD:
            self._past.add(rid)

    def _held(self) -> bool:
        """A hold is set: the test stops a request on purpose, so no wait is a stall."""
        holds = self._holds
        return holds is not None and holds.is_dir() and any(not p.name.endswith(".held") for p in holds.iterdir())

    def _on_stalls(self, now: float) -> None:
        from harness.engines import phases

        stuck = [
            r for r, t in self._last.items() if r in self._born and r not in self._past and now - t >= self.bound_s
        ]
        if not stuck or self._held():
            return
        for rid in stuck:
            self._past.add(rid)
            story = phases.stall_story(self._marks, rid, self._first[rid])
            stall = Stall(rid, now - self._last[rid], story or "no side reached a phase")
            self.stalls.append(stall)
            self._abort(rid, stall.line())

    def _on_deaths(self) -> None:
        new, self._seen = self._deaths[self._seen :], len(self._deaths)
        dead = {d.name for d in new}
        for stack in self._stacks.pd_stacks() if dead else ():
            if not dead & {w.name for w in stack.workers}:
                continue
            for role in ("prefill", "decode"):
                if getattr(stack, role).name in dead:
                    continue
                log.warning("%s died: aborting every request on %s", ", ".join(sorted(dead)), role)
                try:
                    stack.client(role, timeout_s=5.0).abort_all()
                except Exception as e:  # noqa: BLE001 - the client's own timeout stays
                    log.warning("abort_all on %s: %r", role, e)

    def _abort(self, rid: str, why: str) -> None:
        if not rid:
            return
        log.warning("%s: aborting %s on both servers", why, rid)
        for stack in self._stacks.pd_stacks():
            for role in ("decode", "prefill"):
                try:
                    stack.client(role).abort(rid)
                except Exception as e:  # noqa: BLE001 - a server that cannot abort it: the client's timeout stays
                    log.warning("abort of %s on %s: %r", rid, role, e)

    def stop(self) -> None:
        self._done.set()
        self._thread.join(5)
