"""The PD driver: a workload through prefill and decode ranks, with the ledger as the oracle.

Nothing is dropped: a request the pools cannot hold yet waits while running requests decode and free memory.
At the end both sides must be back to their baseline and the run's ledger events are checked. The loop as
numbered steps, with aborts, failed transfers and retractions: docs/modules.md.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Sequence

from harness import ledger
from harness.engines.sim import peer
from harness.engines.sim.errors import PDError
from harness.engines.sim.ranks import Ranks
from harness.engines.sim.workload import KVSpec, PDRequest
from harness.engines.sim.kv_transfer import plan, transfer

logger = logging.getLogger(__name__)


@dataclass
class RunResult:
    """What one :func:`run` did, and the ledger's verdict on it."""

    completed: list[str] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)  # their transfer failed
    retracted: list[str] = field(default_factory=list)  # retracted while decoding (and resumed)
    waited: set[str] = field(default_factory=set)
    max_running: int = 0
    steps: int = 0
    chunks: int = 0
    bytes: int = 0
    transfer_s: float = 0.0
    wall_s: float = 0.0
    events: list[ledger.Event] = field(default_factory=list)
    violations: list[ledger.Violation] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def assert_clean(self) -> None:
        """Raise :class:`PDError` listing idle problems and ledger violations, if any."""
        if self.problems or self.violations:
            causes = ledger.root_causes(self.violations)
            lines = self.problems + [
                line for c in causes for line in (str(c.root), *(f"  then {v}" for v in c.knock_ons))
            ]
            raise PDError(
                f"{len(self.problems)} idle problem(s), {len(self.violations)} ledger violation(s):\n"
                + "\n".join(lines[:40]),
                violations=self.violations,
                problems=self.problems,
            )

    @property
    def gbps(self) -> float:
        """P→D transfer rate (GB/s of KV bytes moved, transfer time only)."""
        return self.bytes / self.transfer_s / 1e9 if self.transfer_s else 0.0

    def summary(self) -> dict[str, Any]:
        """JSON-able summary with the ledger summary inside."""
        return {
            "completed": len(self.completed),
            "aborted": len(self.aborted),
            "failed": len(self.failed),
            "retracted": len(self.retracted),
            "waited": len(self.waited),
            "max_running": self.max_running,
            "steps": self.steps,
            "chunks": self.chunks,
            "bytes": self.bytes,
            "transfer_gbps": round(self.gbps, 4),
            "wall_s": round(self.wall_s, 3),
            "requests_per_s": round((len(self.completed) + len(self.aborted) + len(self.failed)) / self.wall_s, 2)
            if self.wall_s
            else 0.0,
            "problems": list(self.problems),
            "ledger": ledger.summarise(self.events),
        }


class PDPair:
    """The prefill and decode ranks of one PD pair (same TP size: rank r sends to rank r).

    Args:
        prefill: prefill ranks.
        decode: decode ranks.
    """

    def __init__(self, prefill: Ranks, decode: Ranks):
        if len(prefill) != len(decode):
            raise ValueError(f"prefill has {len(prefill)} ranks, decode {len(decode)}: rank→rank needs equal TP")
        self.prefill, self.decode = prefill, decode
        self.link: peer.Link | None = None  # the store-free transport, set by configure()

    def configure(self, spec: KVSpec, reset: bool = False) -> None:
        """Rebuild every rank's pools for ``spec``, check both sides move the same page layout, and
        (re)open the store-free transport over the new buffers (:func:`harness.engines.sim.peer.connect`).

        Args:
            spec: the pool configuration.
            reset: discard whatever a failed run left on the ranks, then verify every rank is idle
                at its baseline (so the next test's verdict is its own).

        Raises:
            PDError: the page layouts differ, or (``reset``) a rank is not idle at its baseline.
        """
        handles_p = [self.prefill.submit(r, "configure", spec, reset) for r in range(len(self.prefill))]
        handles_d = [self.decode.submit(r, "configure", spec, reset) for r in range(len(self.decode))]
        self.prefill.get(handles_p)
        self.decode.get(handles_d)
        if reset:
            problems = _idle_problems(self)
            if problems:
                raise PDError("the PD pair is not clean after a reset: " + "; ".join(problems))
        lp, ld = self.prefill.all("layout")[0], self.decode.all("layout")[0]
        if lp != ld:
            raise PDError(f"page layouts differ: prefill {lp}, decode {ld}")
        self.page_bytes = {k: sum(v) for k, v in lp.items()}
        self.spec = spec
        self.link = peer.connect(self.prefill, self.decode)

    def ledger_marks(self) -> dict[str, list[int]]:
        """Per role and rank, how many ledger events each worker has written so far."""
        return {"prefill": self.prefill.all("ledger_mark"), "decode": self.decode.all("ledger_mark")}

    def events_since(self, marks: dict[str, list[int]]) -> list[ledger.Event]:
        """The ledger events every rank wrote after ``marks`` (from :meth:`ledger_marks`)."""
        events: list[ledger.Event] = []
        for role, ranks in (("prefill", self.prefill), ("decode", self.decode)):
            handles = [ranks.submit(r, "ledger_events", marks[role][r]) for r in range(len(ranks))]
            for batch in ranks.get(handles):
                events.extend(ledger.Event.from_dict(e) for e in batch)
        return events


def _agree(results: list[Any], what: str) -> Any:
    first = results[0]
    if any(r != first for r in results[1:]):
        raise PDError(f"TP ranks disagree on {what}: {results}")
    return first


def run(
    pair: PDPair,
    requests: Sequence[PDRequest],
    *,
    chunk_pages: int = 4,
    max_inflight_bytes: int = 16 << 20,
    groups: dict[str, str] | None = None,
) -> RunResult:
    """Run ``requests`` through the pair and check the ledger of this run.

    Args:
        pair: a configured :class:`PDPair`.
        requests: the workload, in arrival order.
        chunk_pages: pages per transfer chunk.
        max_inflight_bytes: transfer bound on unacknowledged bytes.
        groups: rid -> prefix group (requests of a group share their prompt); default each its own.

    Returns:
        The :class:`RunResult` (``violations`` empty when the books balance).

    Raises:
        PDError: TP ranks disagree, or a request can never be admitted (idle problems at the end
            are returned in ``problems``, not raised).
        KVCorruption / WindowLost / PreallocError: from the decode ranks (the first one raised).
        WorkerDied: a rank's worker died.
        Any of them carries the ledger's violations up to the failure: as ``violations`` (so the
        failure's headline leads with the root cause the ledger names) and as a note (``add_note``).
    """
    marks = pair.ledger_marks()
    try:
        return _run(pair, requests, marks, chunk_pages, max_inflight_bytes, groups or {})
    except Exception as e:
        # Whatever stopped the run (a rank's KVCorruption, sglang's prealloc failure, a request that
        # can never be admitted), the ledger written up to here may say why: attach its verdict.
        _note_ledger(e, pair, marks)
        raise


def _note_ledger(error: BaseException, pair: PDPair, marks: dict[str, list[int]]) -> None:
    try:
        violations = ledger.check(pair.events_since(marks))
    except Exception as e:  # noqa: BLE001 - a dead rank has no ledger to give; the error stands alone
        logger.warning("no ledger verdict for the failed run: %r", e)
        return
    if violations:
        if not getattr(error, "violations", None):
            try:
                error.violations = tuple(violations)  # type: ignore[attr-defined]
            except AttributeError:
                pass  # an exception type without a __dict__: the note still says it
        error.add_note(
            f"ledger at the failure: {len(violations)} violation(s)\n" + "\n".join(str(v) for v in violations[:20])
        )


def _run(
    pair: PDPair,
    requests: Sequence[PDRequest],
    marks: dict[str, list[int]],
    chunk_pages: int,
    max_inflight_bytes: int,
    groups: dict[str, str],
) -> RunResult:
    res = RunResult()
    t0 = time.perf_counter()
    queue = deque(requests)
    running: set[str] = set()
    abort_at = {r.rid: r.abort_after_steps for r in requests if r.abort_after_steps is not None}
    retract_at = {r.rid: r.retract_after_steps for r in requests if r.retract_after_steps is not None}
    decoded: dict[str, int] = {}  # decode steps each running request took
    retracted: set[str] = set()  # retracted, waiting for sglang to resume them
    admissible = True  # False while the queue head waits and nothing has finished since it was refused
    while queue or running or retracted:
        while queue and admissible:
            req = queue[0]
            group = groups.get(req.rid, req.rid)
            dst = pair.decode.all("admit", req.rid, req.prompt_len, req.decode_steps, group)
            if all(d is None for d in dst):
                res.waited.add(req.rid)
                admissible = False
                break
            if any(d is None for d in dst):
                raise PDError(f"TP ranks disagree on admitting {req.rid}: {[d is not None for d in dst]}")
            queue.popleft()
            src = pair.prefill.all("prefill", req.rid, req.prompt_len, group)
            chunks = plan(src, dst, chunk_pages)
            stop = req.abort_after_chunks if req.abort_after_chunks is not None else req.fail_after_chunks
            stats = transfer(
                pair.prefill,
                pair.decode,
                req.rid,
                chunks,
                pair.page_bytes,
                max_inflight_bytes=max_inflight_bytes,
                abort_after=stop,
                link=pair.link,
            )
            failed = stats.aborted and req.abort_after_chunks is None  # stopped by a failure, not an abort
            res.chunks += stats.chunks
            res.bytes += stats.bytes
            res.transfer_s += stats.seconds
            # Prefill frees while decode commits (or drops an aborted request): both sides at once.
            released = [pair.prefill.submit(r, "release", req.rid) for r in range(len(pair.prefill))]
            if failed:
                reason = f"transfer failed after {stats.chunks} of {len(chunks)} chunks"
                finished = [pair.decode.submit(r, "fail", req.rid, reason) for r in range(len(pair.decode))]
            elif stats.aborted:
                finished = [pair.decode.submit(r, "abort", req.rid) for r in range(len(pair.decode))]
            else:
                finished = [
                    pair.decode.submit(r, "commit", req.rid, sorted(d["full"].values()), sorted(d["swa"].values()))
                    for r, d in enumerate(dst)
                ]
            pair.prefill.get(released)
            pair.decode.get(finished)
            if stats.aborted:
                (res.failed if failed else res.aborted).append(req.rid)
                continue
            running.add(req.rid)
            res.max_running = max(res.max_running, len(running))
        stepped = bool(running)
        if stepped:
            done = _agree([sorted(d) for d in pair.decode.all("step")], "finished requests")
            res.steps += 1
            running -= set(done)
            res.completed.extend(done)
            for rid in sorted(running):  # aborted (the client gave up) or retracted once it took its steps
                decoded[rid] = decoded.get(rid, 0) + 1
                if decoded[rid] in (abort_at.get(rid), retract_at.get(rid)):
                    retract = decoded[rid] == retract_at.get(rid)
                    pair.decode.all("retract" if retract else "abort", rid)
                    running.discard(rid)
                    if retract:
                        retracted.add(rid)
                    (res.retracted if retract else res.aborted).append(rid)
                    done.append(rid)
            admissible = admissible or bool(done)  # retry once a request finished and gave its memory back
        if retracted:  # sglang resumes what its admission budgets let in, at each scheduling round
            back = _agree([sorted(r) for r in pair.decode.all("resume")], "resumed requests")
            if not back and not running:
                raise PDError(f"retracted {sorted(retracted)} can never be resumed: the decode pools are idle")
            retracted -= set(back)
            running |= set(back)
        elif queue and not stepped:
            raise PDError(
                f"request {queue[0].rid} (prompt {queue[0].prompt_len}) can never be admitted: "
                "the decode pools are idle and still cannot hold it"
            )
    if pair.spec.radix_cache:
        pair.decode.all("drain_cache")
    res.problems = _idle_problems(pair)
    res.wall_s = time.perf_counter() - t0
    res.events = pair.events_since(marks)
    res.violations = ledger.check(res.events)
    return res


def _idle_problems(pair: PDPair) -> list[str]:
    out = []
    held = pair.prefill.all("held")
    if any(held):
        out.append(f"prefill ranks still hold requests at the end: {held}")
    for rank, state in enumerate(pair.decode.all("idle")):
        if state["live"] or state["free"] != state["baseline"]:
            out.append(
                f"decode rank {rank} not back to baseline when idle: live {state['live']}, "
                f"free {state['free']} vs baseline {state['baseline']}"
            )
    return out
