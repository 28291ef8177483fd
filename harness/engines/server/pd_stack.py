"""A started PD stack (:class:`PdStack`): its three workers, their clients, what decode's log and
environment say about it, and stopping it. :mod:`.stack` starts one.
"""

from __future__ import annotations

import concurrent.futures
import random
from dataclasses import dataclass
from typing import Sequence
from urllib.parse import urlparse

from harness.engines.server.http_client import ServerClient
from harness.workers import Subprocess, Worker

#: The line decode's log gets when sglang gives up fetching a prefill's parallel info from a bootstrap
#: address (``{addr}``: ``host:port``) after its bounded retries, before it fails that address's
#: requests: the same in every supported release (0.5.16 ... 0.5.23).
BOOTSTRAP_GAVE_UP = "Could not fetch prefill parallel info from {addr}"
#: Lines of decode's log read for it (the retries log nothing in between; health checks a few lines).
_GAVE_UP_TAIL = 400
#: How long decode holds a failed transfer's pages for prefill's acknowledgements before it releases
#: them, and sglang's default for it (0.5.23; the CPU recipe sets 5 s).
DEFERRED_RELEASE_ENV, DEFERRED_RELEASE_DEFAULT_S = "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT", 30.0


def deferred_release_s(decode: Worker) -> float:
    """A decode server's deferred-release timeout as it was started (sglang's default if not set)."""
    payload = decode.spec.payload
    env = payload.env if isinstance(payload, Subprocess) else {}
    return float(env.get(DEFERRED_RELEASE_ENV) or DEFERRED_RELEASE_DEFAULT_S)


@dataclass(frozen=True)
class PdStack:
    """A started PD stack: three :class:`harness.workers.Worker` handles and their clients."""

    prefill: Worker
    decode: Worker
    router: Worker
    model: str
    started_s: float = 0.0

    @property
    def workers(self) -> tuple[Worker, ...]:
        return (self.prefill, self.decode, self.router)

    def client(self, which: str, timeout_s: float = 10.0) -> ServerClient:
        """Client of ``prefill``, ``decode`` or ``router``."""
        return ServerClient(getattr(self, which).url("http"), timeout_s)

    def bootstrap_fields(self, rid: str, room: int | None = None) -> dict:
        """The bootstrap fields the router adds to a PD request, for one sent to prefill and decode
        directly (without the router's retries, which bring a failed request back under its rid):
        prefill's host and bootstrap port, and ``room`` (default: one derived from ``rid``)."""
        return {
            "rid": rid,
            "bootstrap_host": urlparse(self.prefill.url("http")).hostname,
            "bootstrap_port": self.prefill.ports["bootstrap"],
            "bootstrap_room": random.Random(rid).randrange(1 << 62) if room is None else room,
        }

    def direct(
        self,
        ids: Sequence[int],
        max_new: int,
        rid: str,
        *,
        room: int | None = None,
        timeout_s: float = 120.0,
        prefill_ids: Sequence[int] | None = None,
    ) -> tuple[concurrent.futures.Future, concurrent.futures.Future]:
        """One PD request sent to prefill and decode directly (:meth:`bootstrap_fields`), each from a
        thread of its own: the two clients' futures, prefill's then decode's (a Generation, or what the
        client raised). ``prefill_ids`` sends prefill another input under the same request (a side that
        refuses what the other admits)."""
        body = self.bootstrap_fields(rid, room)
        inputs = {"prefill": ids if prefill_ids is None else prefill_ids, "decode": ids}
        pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="direct")
        try:
            return tuple(  # type: ignore[return-value]
                pool.submit(lambda r=role: self.client(r).generate(inputs[r], max_new, extra=body, timeout_s=timeout_s))
                for role in ("prefill", "decode")
            )
        finally:
            pool.shutdown(wait=False)

    @property
    def deferred_release_s(self) -> float:
        """Seconds decode may still hold a request's pages after it gave the request up (answered it
        as failed or aborted): its deferred-release timeout as decode was started."""
        return deferred_release_s(self.decode)

    def decode_gave_up_bootstrap(self, addr: str) -> bool:
        """Whether decode's log says sglang gave up the bootstrap address ``addr`` (``host:port``)
        after its retries (:data:`BOOTSTRAP_GAVE_UP`): the phase where it must fail the requests
        sent there."""
        return BOOTSTRAP_GAVE_UP.format(addr=addr) in self.decode.tail(_GAVE_UP_TAIL)

    def check(self) -> None:
        """Raise :class:`harness.workers.WorkerDied` for the first dead worker."""
        for w in self.workers:
            w.check()

    def payload_pids(self) -> list[int]:
        """Process (group) ids of the three server processes."""
        return [w.info.payload_pid for w in self.workers if w.info and w.info.payload_pid]

    def stop(self) -> None:
        """Stop router, decode and prefill side by side (each: SIGTERM its process group, wait, SIGKILL)."""
        stop_all(self.workers)


def stop_all(workers: Sequence[Worker]) -> None:
    """Stop workers side by side (each drains and exits on its own: seconds per server on a CPU).

    Raises:
        Exception: the first one a worker's ``stop`` raised, after every worker was stopped.
    """
    workers = list(workers)
    if len(workers) <= 1:
        for w in workers:
            w.stop()
        return
    with concurrent.futures.ThreadPoolExecutor(len(workers), thread_name_prefix="stop") as pool:
        futures = [pool.submit(w.stop) for w in workers]
    for f in futures:
        f.result()
