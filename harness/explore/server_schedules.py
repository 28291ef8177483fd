"""``harness explore --engine sglang-server``: random schedules over the hold points on a real prefill +
decode + router, bounded by time, each judged by the servers' ledgers and phase trace.

A schedule is a few episodes; each sends some requests that run free, and one that is held at a drawn
phase while the schedule aborts it (or not), then released. At the schedule's end every answer must have
come and both servers must reset clean (``reset_server``: the ledger, the KV digests and the trace rules).
A schedule is its seed: printed, and run again by ``--seed``. Not Hypothesis: one real schedule costs
seconds, too many to shrink by search; the failing schedule prints as steps instead.
"""

from __future__ import annotations

import random
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

from harness.explore import interleave as il

#: Phases a held request stops at, with the chunk (None: any): each sits on one server's scheduler or
#: transfer thread, and the schedule waits only on the held request while it holds.
HOLDABLE: tuple[tuple[str, int | None], ...] = (
    ("decode.prealloc", None),
    ("decode.metadata", None),
    ("prefill.send", 0),
    ("transfer.write", 0),
    ("decode.transferred", None),
)


@dataclass(frozen=True)
class Episode:
    """Free requests sent first (their prompt lengths), then one held at ``phase`` and, if ``abort``,
    aborted there before its release."""

    free: tuple[int, ...]
    held_len: int
    phase: str
    chunk: int | None
    abort: bool

    def line(self) -> str:
        at = self.phase + (f"#{self.chunk}" if self.chunk is not None else "")
        free = f"{len(self.free)} free request(s) {list(self.free)}, " if self.free else ""
        return f"{free}one of {self.held_len} tokens held at {at}" + (", aborted there" if self.abort else "")


def draw(seed: int, episodes: int = 3) -> list[Episode]:
    """The schedule of ``seed``: the same episodes on any machine."""
    rng = random.Random(seed)
    out = []
    for _ in range(episodes):
        phase, chunk = rng.choice(HOLDABLE)
        free = tuple(rng.randrange(40, 300) for _ in range(rng.randrange(0, 3)))
        out.append(Episode(free, rng.randrange(70, 300), phase, chunk, rng.random() < 0.5))
    return out


@dataclass
class Outcome:
    """What one schedule did: its steps as run, and the failure (None: it held)."""

    seed: int
    episodes: list[Episode]
    steps: list[str] = field(default_factory=list)
    failure: str | None = None


def run_schedule(
    stack: Any,
    ledger_dir: str,
    seed: int,
    *,
    reset: Callable[[Any], object],
    timeout_s: float = 120.0,
    prompt: Callable[[int], list[int]] | None = None,
) -> Outcome:
    """Run the schedule of ``seed`` on ``stack``; ``reset(worker)`` resets one server (raises when it
    is not back at baseline: the verdict)."""
    out = Outcome(seed, draw(seed))
    make = prompt or (lambda n: [4 + (31 * i + seed) % 500 for i in range(n)])
    run = il.ServerRun(stack, ledger_dir, timeout_s=timeout_s, prompt=make)
    answers: list[Any] = []
    try:
        for ep in out.episodes:
            for n in ep.free:
                rid = f"harness-x{seed}-{uuid.uuid4().hex[:8]}"
                answers += stack.direct(make(n), 4, rid, timeout_s=3 * timeout_s)
                out.steps.append(f"send {rid} ({n} tokens, free)")
            rid = f"harness-x{seed}-{uuid.uuid4().hex[:8]}"
            script = [il.send(rid, ep.held_len, 4), il.hold(ep.phase, rid, ep.chunk), il.wait(ep.phase, rid, ep.chunk)]
            script += [il.abort(rid)] if ep.abort else []
            script += [il.release(ep.phase, rid, ep.chunk)]
            out.steps += [s.line() for s in script]
            run.run(script)
            answers += run.answers[rid]
        out.steps.append("wait for every answer, then reset both servers")
        deadline = time.monotonic() + 3 * timeout_s
        for a in answers:
            try:
                a.result(timeout=max(0.1, deadline - time.monotonic()))
            except TimeoutError:
                raise il.ScriptError(f"a request of the schedule was not answered within {3 * timeout_s:g} s")
            except Exception:  # noqa: BLE001 - an aborted request's error answer is an answer
                pass
        for w in (stack.decode, stack.prefill):
            reset(w)
    except Exception as e:  # noqa: BLE001 - the verdict of the schedule, reported with its steps
        out.failure = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return out


#: The model and page size of the schedules' stack: the SWA model the in-flight suites serve.
MODEL, PAGE = "tiny-mellum-swa", 64


def explore(
    seed: int,
    seconds: float,
    run_dir: Any,
    *,
    schedules: int | None = None,
    report: Callable[[str], None] = print,
) -> Outcome | None:
    """Run schedules ``seed``, ``seed + 1``, ... on one real CPU stack until ``seconds`` pass (or
    ``schedules`` ran); the first that breaks is returned (None: none broke). The stack starts once;
    a schedule that breaks it ends the run."""
    from harness import topology
    from harness.cluster import Cluster
    from harness.engines.server.reset import reset_server
    from harness.engines.server.stack_pool import StackPool, counted_names

    topo = topology.get("cpu")
    started = time.monotonic()
    with Cluster.start(topo) as cluster:
        pool = StackPool(
            cluster, topo, run_dir, server_args=("--page-size", str(PAGE)), unique_name=counted_names("x-")
        )
        try:
            stack = pool.pd(MODEL)
            report(f"explore: stack ready in {stack.started_s:.0f} s")
            ran, steps = 0, 0
            while (schedules is None or ran < schedules) and time.monotonic() - started < seconds:
                out = run_schedule(
                    stack,
                    str(run_dir.ledger),
                    seed + ran,
                    reset=lambda w: reset_server(w, run_dir.ledger_file(w.name), timeout_s=90),
                )
                ran, steps = ran + 1, steps + len(out.steps)
                report(f"explore: {ran} schedule(s), {steps} step(s), {time.monotonic() - started:.0f} s")
                if out.failure is not None:
                    return out
            return None
        finally:
            left = pool.close()
            if left:
                report(f"explore: server processes left after the run: {left}")
