"""A soak on a real sglang PD stack: :mod:`harness.engines.soak_driver`'s requests through prefill + decode + router,
every pool of both servers back at its baseline exactly at every checkpoint, read by the servers'
accounting probes.

:class:`StackEngine` is the real stack's engine (the simulated one is
:class:`harness.engines.sim.sim_soak.PairEngine`; both run :func:`harness.engines.soak_driver.drive`, so the
same seed gives the same requests). How a batch sends and aborts, and a checkpoint's steps: docs/modules.md.
"""

from __future__ import annotations

import concurrent.futures
import random
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any, Sequence

import requests

from harness import ledger
from harness.clock import Deadline, wait_for
from harness.engines.interface import BatchOutcome, Checkpoint, SoakRequest
from harness.engines.soak_driver import SoakResult, drive
from harness.engines.server.http_client import Generation, ServerHTTPError
from harness.engines.server.reset import ResetError, reset_server
from harness.engines.server.pd_stack import PdStack
from harness.ledger.resources import RESOURCES

#: New tokens an aborted request asks for (enough that the abort lands before it finishes).
ABORT_NEW = 200
#: Most seconds between sending a request and aborting it (seeded per request).
ABORT_DELAY_S = 0.3
#: Seconds between aborts of a request that has not answered yet (an abort that came before the
#: request reached decode is a no-op: sglang answers 200 whether or not it knew the request).
ABORT_RETRY_S = 0.5
#: Seconds a request has to answer.
GENERATE_S = 120.0
#: Seconds decode has to release every prealloc of a batch (an aborted transfer: a missed 1 s heartbeat,
#: then at most the 5 s deferred-release wait of the CPU recipe), and each server to go idle and flush.
RELEASE_S = 30.0
RESET_S = 60.0
_POLL_S = 0.2


def tokens(key: str, n: int) -> list[int]:
    """``n`` deterministic token ids (4..511) seeded by ``key``."""
    rng = random.Random(key)
    return [rng.randrange(4, 512) for _ in range(n)]


def _unreleased(path: Path, rids: Sequence[str]) -> list[str]:
    """The rids of ``rids`` that decode's ledger shows preallocated more often than released."""
    counts = Counter((e.kind, e.rid) for e in ledger.read(path)) if path.exists() else Counter()
    return [r for r in rids if counts[("prealloc", r)] > counts[("release", r)]]


def server_rid(tag: str, rid: str) -> str:
    """The rid a soak request goes to the servers under, none of them a prefix of another.

    sglang's ``/abort_request`` aborts every request whose rid *starts with* the one given (the
    sub-requests of an ``n > 1`` request): aborting ``s9-1`` while it is still live on a server and
    ``s9-11`` is in flight there aborts that one too. The mix's rids are ``<batch>-<i>`` (letters,
    digits, ``-``), so a closing ``.`` makes the set prefix-free.

    >>> server_rid("ab12", "s9-1"), server_rid("ab12", "s9-11").startswith(server_rid("ab12", "s9-1"))
    ('soak-ab12-s9-1.', False)
    """
    return f"soak-{tag}-{rid}."


class StackEngine:
    """A real :class:`~.pd_stack.PdStack` as a :class:`harness.engines.interface.Engine`.

    Creating it resets both servers (their baselines: the free sizes that flush left).

    Raises:
        ResetError: a server could not be reset to baseline before the soak.
        WorkerDied: a server died.
    """

    def __init__(self, stack: PdStack, ledger_dir: str | Path, *, seed: int = 0, concurrency: int = 4) -> None:
        self.stack = stack
        self.seed = seed  # the prompts' (the mix's request ids repeat across seeds)
        self.concurrency = concurrency
        self.tag = uuid.uuid4().hex[:8]  # rids unique across soaks on one server
        self.servers = {"prefill": stack.prefill, "decode": stack.decode}
        self.ledgers = {role: Path(ledger_dir) / f"{w.name}.jsonl" for role, w in self.servers.items()}
        try:
            self.baseline = {
                role: dict(reset_server(w, self.ledgers[role], timeout_s=RESET_S).free_after)
                for role, w in self.servers.items()
            }
        except ResetError as e:
            raise ResetError(f"before the soak, not at baseline: {e}") from None
        self.batch_rids: list[str] = []

    # ------------------------------------------------------------------ a batch

    def _prompt(self, r: SoakRequest) -> list[int]:
        return tokens(f"{self.seed}-{r.group or r.rid}", r.length)

    def _send(self, r: SoakRequest, rid: str, new: int) -> Generation:
        return self.stack.client("router").generate(self._prompt(r), new, extra={"rid": rid}, timeout_s=GENERATE_S)

    def _one(self, r: SoakRequest, aborter: concurrent.futures.Executor) -> tuple[str, Any]:
        """``(what, detail)``: ``completed`` (detail: the Generation), ``aborted`` or ``failed`` (why)."""
        rid = server_rid(self.tag, r.rid)
        if not r.abort:
            try:
                got = self._send(r, rid, r.new_tokens)
            except (ServerHTTPError, requests.RequestException) as e:
                return "failed", f"{rid}: {e}"
            if len(got.output_ids) != r.new_tokens:
                return (
                    "failed",
                    f"{rid}: {len(got.output_ids)} of {r.new_tokens} tokens ({got.meta.get('finish_reason')})",
                )
            return "completed", got
        # Sent to both servers directly, with the bootstrap fields the router would add: the router
        # retries a request that failed under the same rid, so an aborted one would come back, and two
        # of its tries could hold decode pages at once under one rid.
        body = self.stack.bootstrap_fields(rid)
        ids = self._prompt(r)
        clients = [self.stack.client(role) for role in ("prefill", "decode")]
        answers = [aborter.submit(c.generate, ids, ABORT_NEW, extra=body, timeout_s=GENERATE_S) for c in clients]
        time.sleep(random.Random(rid).uniform(0.0, ABORT_DELAY_S))
        deadline = Deadline(GENERATE_S)
        while not all(a.done() for a in answers) and not deadline.expired():
            for c in clients:
                try:
                    c.abort(rid)
                except (
                    ServerHTTPError,
                    requests.RequestException,
                ) as e:  # a dead server: the verdict's, not a traceback
                    return "failed", f"{rid}: aborting it on {c.base_url} failed: {e}"
            concurrent.futures.wait(answers, timeout=ABORT_RETRY_S)
        try:
            outcome = [a.result(timeout=deadline.left()) for a in answers]
        except (ServerHTTPError, requests.RequestException):
            return "aborted", None  # a server answers an aborted request with an error
        except concurrent.futures.TimeoutError:
            return "failed", f"{rid}: no answer within {GENERATE_S:g} s of its abort"
        got = outcome[1]
        finish = (got.meta.get("finish_reason") or {}).get("type", "")
        if finish == "abort":
            return "aborted", got
        return "completed", got  # the abort came after its last token

    def run_batch(self, requests_: Sequence[SoakRequest]) -> BatchOutcome:
        self.stack.check()
        self.batch_rids = [server_rid(self.tag, r.rid) for r in requests_]
        with (
            concurrent.futures.ThreadPoolExecutor(self.concurrency, thread_name_prefix="soak") as pool,
            concurrent.futures.ThreadPoolExecutor(2 * self.concurrency, thread_name_prefix="soak-abort") as aborter,
        ):
            outcomes = list(pool.map(lambda r: self._one(r, aborter), requests_))
        self.stack.check()
        completed = [d for what, d in outcomes if what == "completed"]
        failed = [d for what, d in outcomes if what == "failed"]
        hits = sum(1 for g in completed if int(g.meta.get("cached_tokens") or 0) > 0)
        failure = (
            AssertionError(f"{len(failed)} request(s) of the batch failed: " + "; ".join(failed[:3]))
            if failed
            else None
        )
        return BatchOutcome(len(completed), sum(1 for what, _ in outcomes if what == "aborted"), hits, failure)

    # ------------------------------------------------------------------ a checkpoint

    def checkpoint(self, requests_: int) -> Checkpoint:
        problems: list[str] = []

        def released() -> bool:
            self.stack.check()  # a dead server fails the soak at once, naming it
            return not _unreleased(self.ledgers["decode"], self.batch_rids)

        held: list[str] = []
        try:
            wait_for(released, RELEASE_S, "decode releasing the batch", interval=_POLL_S)
        except TimeoutError:
            held = _unreleased(self.ledgers["decode"], self.batch_rids)
            problems.append(f"decode never released {len(held)} request(s) within {RELEASE_S:g} s (e.g. {held[:3]})")
        leak: dict[str, int] = {}
        for role, w in self.servers.items():
            seen = sum(1 for e in ledger.read(self.ledgers[role]) if e.kind == "reset")
            try:
                reset_server(w, self.ledgers[role], timeout_s=RESET_S)
            except ResetError as e:
                problems.append(str(e))
            resets = [e for e in ledger.read(self.ledgers[role]) if e.kind == "reset"]
            if len(resets) <= seen:
                problems.append(f"{role}: no flush, so no pool read")
                continue
            # Free plus cached just before the flush: sglang's flush clears the allocator, so what it
            # leaves free is the whole pool whatever had leaked; what was neither free nor cached had.
            idle = resets[-1].free_before
            for pool, base in self.baseline[role].items():
                counts_held = pool in RESOURCES and RESOURCES[pool].counts == "held"  # a count of what is held
                leak[f"{role}.{pool}"] = (
                    (int(idle.get(pool, 0)) - base) if counts_held else (base - int(idle.get(pool, 0)))
                )
        return Checkpoint(requests_, leak, len(held), "; ".join(problems) or None)


def soak_stack(
    stack: PdStack,
    ledger_dir: str | Path,
    n: int,
    *,
    every: int = 25,
    seed: int = 0,
    page_size: int = 64,
    max_prompt: int | None = None,
    max_new: int = 8,
    concurrency: int = 4,
) -> SoakResult:
    """Run ``n`` requests through a real PD stack in batches of ``every``, a checkpoint after each
    (:func:`harness.engines.soak_driver.drive` over a :class:`StackEngine`).

    Args:
        stack: a ready stack whose servers run the accounting probe.
        ledger_dir: the run directory's ledger folder (``<run_dir>/ledger``).
        n: requests in all.
        every: requests per batch (and so between checkpoints).
        seed: the mix's seed (batch ``b`` uses ``seed + b``).
        page_size: the servers' page size (the mix puts prompt lengths at its boundaries).
        max_prompt: longest prompt (default: four pages).
        max_new: most new tokens of a request that is not aborted (keep it short on a CPU).
        concurrency: requests in flight at once.

    Returns:
        The :class:`~harness.engines.soak_driver.SoakResult`
        (:meth:`~harness.engines.soak_driver.SoakResult.assert_clean` is the verdict).

    Raises:
        ResetError: a server was not back at baseline before the soak.
        WorkerDied: a server died.
    """
    engine = StackEngine(stack, ledger_dir, seed=seed, concurrency=concurrency)
    return drive(
        engine, n, every=every, seed=seed, page_size=page_size, max_prompt=max_prompt or 4 * page_size, max_new=max_new
    )
