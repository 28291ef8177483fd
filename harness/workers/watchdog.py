"""The fail-fast watchdog: a background thread that polls started workers and the raylets of their
nodes, and reports each death once (the pytest plugin turns it into the running test's failure)."""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from harness.workers.handle import Worker
from harness.workers.node_ref import raylet_answers
from harness.workers.spec import WorkerDied

log = logging.getLogger(__name__)


class Watchdog:
    """Polls workers from a background thread; calls ``on_death(WorkerDied)`` once per dead worker.

    The pytest plugin uses it to fail the running test within ~2 s of a worker's death. Each round
    also knocks on the raylet of every node a watched worker runs on: a node whose raylet has not
    answered for ``node_grace`` seconds is lost, and every worker on it is reported dead with the
    node named (Ray itself says so only when its health check gives up, ~15 s later).
    """

    def __init__(self, on_death: Callable[[WorkerDied], None], interval: float = 0.25, node_grace: float = 1.0):
        self._on_death = on_death
        self._interval = interval
        self._node_grace = node_grace
        self._workers: list[Worker] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._silent_since: dict[str, float] = {}

    def add(self, worker: Worker) -> None:
        with self._lock:
            self._workers.append(worker)

    def remove(self, worker: Worker) -> None:
        self._take(worker)

    def start(self) -> "Watchdog":
        self._thread = threading.Thread(target=self._run, name="harness-watchdog", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _lost_nodes(self, workers: list[Worker]) -> dict[str, str]:
        """node id -> why, for the nodes of ``workers`` whose raylet stayed silent for ``node_grace``."""
        lost = {}
        nodes = {w.node.node_id: w.node for w in workers if w.node is not None and not w._stopped}
        for node_id, node in nodes.items():
            why = raylet_answers(node.ip, node.port)
            if why is None:
                self._silent_since.pop(node_id, None)
                continue
            since = self._silent_since.setdefault(node_id, time.monotonic())
            if time.monotonic() - since >= self._node_grace:
                lost[node_id] = f"raylet {why} for {time.monotonic() - since:.1f} s"
        return lost

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            with self._lock:
                workers = list(self._workers)
            lost = self._lost_nodes(workers)
            for w in workers:
                if w.node is not None and w.node.node_id in lost and not w._stopped and self._take(w):
                    self._on_death(w.node_lost(lost[w.node.node_id]))
            workers = [w for w in workers if not (w.node is not None and w.node.node_id in lost)]
            for w in workers:
                if w._stopped:
                    continue
                try:
                    cause = w.poll(timeout=2.0)
                except Exception as e:  # Ray gone during teardown
                    log.debug("watchdog poll %s: %r", w.name, e)
                    continue
                if cause and self._take(w):
                    self._on_death(w._died(cause))

    def _take(self, worker: Worker) -> bool:
        """Stop watching ``worker``; False if :meth:`remove` got there first. The round works on a
        snapshot, so a worker removed (then killed on purpose) while it was being polled is still in
        it: its death is not this watchdog's to report."""
        with self._lock:
            if worker not in self._workers:
                return False
            self._workers.remove(worker)
            return True
