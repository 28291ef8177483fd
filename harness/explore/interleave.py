"""One interleaving script, two engines: hold at a phase, act, release, wait for the next phase, on the
in-process simulated pair (:class:`SimRun`) and on a real PD stack (:class:`ServerRun`) alike.

A script is a list of :class:`Step`. The phase names are the servers' (:mod:`harness.engines.phases`); on
the pair each operation passes the phases of :data:`OP_PHASES`, and a held phase is reached (traced) but not
passed until released. Every wait is proven by a trace mark, never by time. Own code, not a library: it
drives the harness's own pair and hold files.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from harness.engines import phases

#: The phases each operation of the simulated pair passes, in order (``#`` marks the chunk's index).
OP_PHASES: dict[str, tuple[str, ...]] = {
    "prealloc": ("decode.prealloc", "decode.metadata"),
    "prefill": ("prefill.forwarded",),
    "transfer": ("prefill.send#", "transfer.write#", "transfer.written#"),
    "commit": ("decode.transferred", "decode.commit", "prefill.release"),
    "abort": ("decode.release", "decode.released"),
}


@dataclass(frozen=True)
class Step:
    """One step: ``send`` (a request of ``prompt_len`` tokens and ``max_new`` new ones), ``hold`` /
    ``release`` a phase, ``wait`` until a phase is reached, ``abort`` the request on decode."""

    kind: str
    rid: str
    phase: str = ""
    chunk: int | None = None
    prompt_len: int = 0
    max_new: int = 0

    def line(self) -> str:
        at = f" {self.phase}" + (f"#{self.chunk}" if self.chunk is not None else "") if self.phase else ""
        return f"{self.kind}{at} {self.rid}"


def _named(phase: str) -> str:
    if phase not in phases.PHASES:
        raise phases.PhaseError(f"phase {phase!r}: not one of {', '.join(phases.PHASES)}")
    return phase


def send(rid: str, prompt_len: int, max_new: int) -> Step:
    return Step("send", rid, prompt_len=prompt_len, max_new=max_new)


def hold(phase: str, rid: str, chunk: int | None = None) -> Step:
    return Step("hold", rid, _named(phase), chunk)


def release(phase: str, rid: str, chunk: int | None = None) -> Step:
    return Step("release", rid, _named(phase), chunk)


def wait(phase: str, rid: str, chunk: int | None = None) -> Step:
    return Step("wait", rid, _named(phase), chunk)


def abort(rid: str) -> Step:
    return Step("abort", rid)


def abort_at_held_send(rid: str, prompt_len: int = 200, max_new: int = 4) -> list[Step]:
    """Decode aborts a request while prefill holds its first chunk's send: everything it took is freed."""
    return [
        send(rid, prompt_len, max_new),
        hold("prefill.send", rid, chunk=0),
        wait("prefill.send", rid, chunk=0),
        abort(rid),
        release("prefill.send", rid),
        wait("decode.released", rid),
    ]


class ScriptError(AssertionError):
    """A step could not be done on the engine: names the step and where the request was."""


class SimRun:
    """Runs scripts on an :class:`harness.explore.pair.Pair`; ``marks`` is the trace it passed."""

    def __init__(self, pair: Any) -> None:
        self.pair = pair
        self.marks: list[phases.Mark] = []
        self._rid: dict[str, str] = {}  # script rid -> the pair's
        self._held: set[tuple[str, str, int | None]] = set()

    def run(self, script: list[Step]) -> list[phases.Mark]:
        for step in script:
            getattr(self, "_" + step.kind)(step)
        return self.marks

    def _mark(self, phase: str, rid: str, chunk: int | None = None, note: str = "") -> None:
        self.marks.append(phases.Mark(time.time(), "sim", phase, rid, None, chunk, note))

    def _reached(self, phase: str, rid: str, chunk: int | None) -> bool:
        return any(m.phase == phase and m.rid == rid and (chunk is None or m.chunk == chunk) for m in self.marks)

    def _send(self, step: Step) -> None:
        self._rid[step.rid] = self.pair.apply(
            "submit", prompt_len=step.prompt_len, group=len(self._rid), steps=step.max_new
        ).outcome

    def _hold(self, step: Step) -> None:
        self._held.add((step.phase, step.rid, step.chunk))

    def _release(self, step: Step) -> None:
        self._held = {h for h in self._held if h[:2] != (step.phase, step.rid) or step.chunk not in (None, h[2])}

    def _abort(self, step: Step) -> None:
        self.pair.apply("abort", rid=self._rid[step.rid])
        for phase in OP_PHASES["abort"]:
            self._mark(phase, step.rid, note="drained" if phase == "decode.released" else "")

    def _wait(self, step: Step) -> None:
        """Advance the request one operation at a time until ``step``'s phase is reached; an operation
        whose phases cross a held one stops there (that phase traced, the operation not run)."""
        rid, pair_rid = step.rid, self._rid[step.rid]
        while not self._reached(step.phase, rid, step.chunk):
            op = pair_rid in self.pair.reqs and self.pair.next_op(pair_rid)
            if not op:
                last = [m.phase for m in self.marks if m.rid == rid][-1:] or ["none"]
                raise ScriptError(f"{step.line()}: the request went as far as it goes (last phase {last[0]})")
            chunk = self.pair.reqs[pair_rid].sent if op == "transfer" else None
            crossing = [(p.rstrip("#"), chunk if p.endswith("#") else None) for p in OP_PHASES.get(op, ())]
            for i, (phase, c) in enumerate(crossing):
                if (phase, rid, c) in self._held or (phase, rid, None) in self._held:
                    if not self._reached(phase, rid, c):
                        for p, pc in crossing[: i + 1]:
                            self._mark(p, rid, pc)
                    if self._reached(step.phase, rid, step.chunk):
                        return
                    raise ScriptError(f"{step.line()}: the request is held at {phase} (release it first)")
            self.pair.apply(op, rid=pair_rid)
            for phase, c in crossing:
                if not self._reached(phase, rid, c):
                    self._mark(phase, rid, c)
            req = self.pair.reqs.get(pair_rid)
            if op == "transfer" and req is not None and req.sent == len(req.chunks):
                self._mark("prefill.sent", rid)


class ServerRun:
    """Runs scripts on a real PD stack (:class:`harness.engines.server.pd_stack.PdStack`): hold files,
    the decode client's abort, and the phase trace under ``ledger_dir``."""

    def __init__(self, stack: Any, ledger_dir: str, *, timeout_s: float = 120.0, prompt: Any = None) -> None:
        self.stack, self.ledger_dir, self.timeout_s = stack, ledger_dir, timeout_s
        self.prompt = prompt or (lambda n: [4 + (7 * i) % 500 for i in range(n)])
        self.answers: dict[str, tuple[Any, Any]] = {}
        self._holds: dict[tuple[str, str, int | None], phases.Hold] = {}

    def run(self, script: list[Step]) -> list[phases.Mark]:
        try:
            for step in script:
                getattr(self, "_" + step.kind)(step)
        finally:
            for h in self._holds.values():
                h.release()
        return [m for m in phases.read_trace(self.ledger_dir) if m.rid in self.answers]

    def _send(self, step: Step) -> None:
        self.answers[step.rid] = self.stack.direct(
            self.prompt(step.prompt_len), step.max_new, step.rid, timeout_s=3 * self.timeout_s
        )

    def _hold(self, step: Step) -> None:
        self._holds[(step.phase, step.rid, step.chunk)] = phases.Hold(self.ledger_dir, step.phase, step.rid, step.chunk)

    def _release(self, step: Step) -> None:
        for key in [k for k in self._holds if k[:2] == (step.phase, step.rid) and step.chunk in (None, k[2])]:
            self._holds.pop(key).release()

    def _abort(self, step: Step) -> None:
        self.stack.client("decode").abort(step.rid)

    def _wait(self, step: Step) -> None:
        held = self._holds.get((step.phase, step.rid, step.chunk))
        if held is not None:
            held.reached(self.timeout_s)
            return
        phases.wait_mark(
            self.ledger_dir,
            step.phase,
            rid=step.rid,
            timeout_s=self.timeout_s,
            where=lambda m: step.chunk is None or m.chunk == step.chunk,
        )
