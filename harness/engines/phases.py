"""The named phases of a PD request, and the hold files and trace that reach and prove them on any engine.

A test holds a request at a phase (:class:`Hold`: a file the engine looks for there), acts, releases it,
and proves each phase was reached by the marker the engine wrote (``.held``) or by the phase trace
(:func:`read_trace`: one line per phase each worker passed). Keyed by request id or by bootstrap room.
Own code, not a library: the engines wait inside sglang's own threads, and files are what crosses the
process boundary without a channel of its own. Where each phase sits in sglang: docs/modules.md.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

from harness.clock import Deadline

#: Each phase: (the side that passes it, where in sglang). Order: a request's life.
PHASES: dict[str, tuple[str, str]] = {
    "prefill.register": (
        "prefill",
        "a starting prefill about to register with its bootstrap server (CommonKVManager.register_to_bootstrap): "
        "keyed by its worker name",
    ),
    "decode.prefill-info": (
        "decode",
        "decode asked a bootstrap server it had no answer from yet for its prefill's parallel info "
        "(try_ensure_parallel_info): note says the address and ready or not ready",
    ),
    "decode.prealloc": ("decode", "pages preallocated (DecodePreallocQueue._pre_alloc returned)"),
    "decode.metadata": ("decode", "its page list about to go to prefill (_send_kv_metadata)"),
    "transfer.status": ("prefill", "a room's status about to be written (CommonKVManager.update_status)"),
    "transfer.lost-update": (
        "prefill",
        "a status write replaced WaitingForInput written since its read (sglang's race)",
    ),
    "transfer.resurrected": (
        "prefill",
        "a status write put back a room its sender had cleared (sglang's race: kept for good)",
    ),
    "prefill.forwarded": ("prefill", "chunk i's forward done, its result not yet processed (process_batch_result)"),
    "prefill.send": ("prefill", "chunk i forwarded, about to be sent (send_kv_chunk)"),
    "prefill.sent": ("prefill", "the sender polled Success: every chunk landed"),
    "prefill.release": ("prefill", "about to free the request's KV (release_kv_cache)"),
    "prefill.cleared": ("prefill", "the sender cleared its room from the KV manager (CommonKVSender.clear)"),
    "decode.transferred": ("decode", "transfer polled done, not yet committed (_commit_transfer_to_req)"),
    "decode.commit": ("decode", "the transfer committed to the request (_commit_transfer_to_req returned)"),
    "decode.defer": ("decode", "a failed transfer's release deferred until prefill's drain ack (_defer_release)"),
    "transfer.write": ("prefill", "a transfer worker about to write a chunk into decode's pages (send_kvcache)"),
    "transfer.written": ("prefill", "a transfer worker's chunk write returned"),
    "transfer.abort": ("prefill", "decode's abort notice handled by prefill's KV manager (its ack decided)"),
    "transfer.ack-sent": ("prefill", "prefill sent decode its drain ack for an aborted room (_send_abort_ack)"),
    "transfer.ack": ("decode", "prefill's drain ack delivered to decode's KV manager (note_abort_ack)"),
    "decode.release": ("decode", "a deferred release about to resolve (_do_release)"),
    "decode.released": ("decode", "a deferred release resolved: note says drained or timeout"),
}

SIDES = ("prefill", "decode")

#: The phases where a hold may drop the message that phase is about to send instead of holding it
#: (:class:`Hold` ``drop=True``): a lost bootstrap message, planted for one request.
DROPPABLE = {"decode.metadata": "decode's page list to prefill (its KV receiver's send_metadata)"}
#: What a dropping hold's file holds (the engine reads it; an empty file holds).
DROP = "drop"

#: The longest any hold waits for its file to go (seconds); then the engine goes on and logs it.
MAX_HOLD_S = 300.0
_POLL_S = 0.02
#: How often a wait looks in the trace for the request's lost status update (a race that ends it).
_LOST_POLL_S = 0.5
_KEY = re.compile(r"^[A-Za-z0-9._:-]{1,200}$")


class PhaseError(ValueError):
    """A phase or key that does not exist: one line naming it."""


def room_key(room: int) -> str:
    """The key of a bootstrap room (phases of the transfer engine know rooms, not request ids)."""
    return f"room-{int(room)}"


def room_of_key(key: str) -> int | None:
    """The room a :func:`room_key` names (None: the key is a request id)."""
    digits = key[len("room-") :] if key.startswith("room-") else ""
    return int(digits) if digits.isdigit() else None


def hold_name(phase: str, key: str, chunk: int | str | None = None, side: str | None = None) -> str:
    """The hold file's name: ``[SIDE:]PHASE[#CHUNK]@KEY``; ``chunk`` narrows a phase passed more than once
    per request: a chunk's index (``prefill.send``), the status being written (``transfer.status``);
    ``side`` narrows a phase both servers pass (``transfer.status``) to one of them."""
    if side is not None and side not in SIDES:
        raise PhaseError(f"side {side!r}: not one of {', '.join(SIDES)}")
    if phase not in PHASES:
        raise PhaseError(f"phase {phase!r}: not one of {', '.join(PHASES)}")
    if not _KEY.match(key):
        raise PhaseError(f"hold key {key!r}: letters, digits and ._:- only (a request id or room-N)")
    name = f"{phase}#{chunk}@{key}" if chunk is not None else f"{phase}@{key}"
    return f"{side}:{name}" if side else name


def hold_dir(ledger_dir: str | os.PathLike) -> Path:
    """Where a run's hold files live: the ledger directory's ``hold/``."""
    return Path(ledger_dir) / "hold"


def trace_dir(ledger_dir: str | os.PathLike) -> Path:
    """Where a run's phase traces live: the ledger directory's ``trace/`` (one file per worker)."""
    return Path(ledger_dir) / "trace"


class Hold:
    """One hold: the engine stops the request ``key`` at ``phase`` (chunk ``chunk`` only, if given)
    until :meth:`release`; usable as a context manager (released on leaving). With ``drop`` (a phase of
    :data:`DROPPABLE` only) the engine does not stop: it marks the hold reached and loses the message the
    phase was about to send, once."""

    def __init__(
        self,
        ledger_dir: str | os.PathLike,
        phase: str,
        key: str,
        chunk: int | str | None = None,
        *,
        side: str | None = None,
        drop: bool = False,
    ) -> None:
        if drop and phase not in DROPPABLE:
            raise PhaseError(f"phase {phase!r} sends no message a hold can drop; droppable: {', '.join(DROPPABLE)}")
        self.path = hold_dir(ledger_dir) / hold_name(phase, key, chunk, side)
        self.phase, self.key, self.chunk = phase, key, chunk
        self.ledger_dir, self.since = ledger_dir, time.time()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(DROP if drop else "")

    @property
    def marker(self) -> Path:
        return self.path.with_name(self.path.name + ".held")

    def held(self) -> bool:
        """True once the engine is waiting at the phase."""
        return self.marker.exists()

    def reached(self, timeout_s: float, *, died: Callable[[], str | None] | None = None) -> None:
        """Wait until the engine holds here; TimeoutError naming the phase if it does not within
        ``timeout_s``. ``died``: called between looks, a text (why the engine can no longer get
        here) raises at once."""
        deadline = Deadline(timeout_s)
        looked = 0.0
        while not self.held():
            why = died() if died is not None else None
            if not why and time.monotonic() - looked >= _LOST_POLL_S:
                looked = time.monotonic()
                room = room_of_key(self.key)
                why = lost_update(read_trace(self.ledger_dir), "" if room is not None else self.key, room, self.since)
            if why:
                raise TimeoutError(f"hold {self.path.name}: never reached: {why}")
            if deadline.expired():
                raise TimeoutError(f"hold {self.path.name}: not reached within {timeout_s:g} s")
            deadline.sleep(_POLL_S)

    def release(self) -> None:
        """Let the engine go on (idempotent)."""
        self.path.unlink(missing_ok=True)

    def __enter__(self) -> "Hold":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def wait_at_hold(
    directory: Path, names: Iterable[str], on_hold: Callable[[str], None], *, droppable: bool = False
) -> str | None:
    """The engine's side: if one of ``names`` is a hold file in ``directory``, mark it held, call
    ``on_hold(name)`` and wait until it is removed (at most :data:`MAX_HOLD_S`); returns the name held
    (None: no hold). A dropping hold (``droppable`` phases only) is marked held and removed at once, and
    :data:`DROP` returned: the caller loses its message. Called inside sglang's threads: nothing here raises."""
    for name in names:
        gate = directory / name
        if not gate.exists():
            continue
        try:
            gate.with_name(name + ".held").touch()
            dropping = droppable and gate.read_text() == DROP
        except OSError:
            return None
        on_hold(name)
        if dropping:
            gate.unlink(missing_ok=True)  # once: a retry of the message goes
            return DROP
        deadline = Deadline(MAX_HOLD_S)
        while gate.exists() and not deadline.expired():
            deadline.sleep(_POLL_S)
        return name
    return None


@dataclass(frozen=True)
class Mark:
    """One line of a phase trace: ``worker`` passed ``phase`` for ``rid`` / ``room`` at ``t`` (epoch
    seconds); ``chunk`` for per-chunk phases, ``note`` what the engine added (a status, an outcome)."""

    t: float
    worker: str
    phase: str
    rid: str = ""
    room: int | None = None
    chunk: int | str | None = None
    note: str = ""

    def to_json(self) -> str:
        return json.dumps(
            {k: v for k, v in self.__dict__.items() if v not in (None, "")}, separators=(",", ":"), sort_keys=True
        )


def read_trace(ledger_dir: str | os.PathLike) -> list[Mark]:
    """Every mark of every worker's trace under ``ledger_dir``, by time (a torn last line is skipped)."""
    marks: list[Mark] = []
    d = trace_dir(ledger_dir)
    for path in sorted(d.glob("*.jsonl")) if d.is_dir() else ():
        for line in path.read_text(errors="replace").splitlines():
            try:
                marks.append(Mark(**json.loads(line)))
            except (ValueError, TypeError):
                continue
    return sorted(marks, key=lambda m: m.t)


def marks_of(marks: Iterable[Mark], rid: str = "", room: int | None = None) -> list[Mark]:
    """The marks of one request: by its id, or by its room."""
    return [m for m in marks if (rid and m.rid == rid) or (room is not None and m.room == room)]


def wait_mark(
    ledger_dir: str | os.PathLike,
    phase: str,
    *,
    rid: str = "",
    room: int | None = None,
    timeout_s: float,
    count: int = 1,
    where: Callable[[Mark], bool] = lambda m: True,
) -> list[Mark]:
    """The marks of ``phase`` for the request (those ``where`` accepts), once there are ``count``;
    TimeoutError naming the last phase the request did reach, if not within ``timeout_s``."""
    if phase not in PHASES:
        raise PhaseError(f"phase {phase!r}: not one of {', '.join(PHASES)}")
    deadline = Deadline(timeout_s)
    while True:
        marks = read_trace(ledger_dir)
        mine = marks_of(marks, rid, room)
        got = [m for m in mine if m.phase == phase and where(m)]
        if len(got) >= count:
            return got
        why = lost_update(marks, rid, room) if phase != "transfer.lost-update" else None
        if why:
            raise TimeoutError(f"{phase} of {rid or room_key(room or 0)} never reached: {why}")
        if deadline.expired():
            last = f"its last phase {mine[-1].phase} ({mine[-1].worker})" if mine else "no phase at all"
            raise TimeoutError(f"{phase} of {rid or room_key(room or 0)} not reached within {timeout_s:g} s: {last}")
        deadline.sleep(_POLL_S * 5)


def lost_update(marks: Iterable[Mark], rid: str, room: int | None, since: float = 0.0) -> str | None:
    """Why the request (``rid`` or ``room``) will not reach another phase: the trace ``marks`` show its room
    lost its status update since ``since`` (sglang's race; the stack watcher aborts such a request at once);
    else None."""
    marks = list(marks)
    rooms = {room} if room is not None else set()
    if rid:
        rooms |= {m.room for m in marks if m.rid == rid and m.room is not None}
    hit = [m for m in marks if m.phase == "transfer.lost-update" and m.room in rooms and m.t >= since]
    if not hit:
        return None
    return f"its room {hit[0].room} lost its status update (sglang's race: the harness aborted the request)"


def early_releases(marks: Iterable[Mark], timeout_s: float) -> list[str]:
    """Deferred releases that went before prefill's drain ack and before their own timeout: decode
    resolved a release as ``timeout`` sooner than ``timeout_s`` after deferring it (pages prefill may
    still write). One line each, naming the room and the request."""
    deferred: dict[tuple[str, int | None], float] = {}
    found = []
    for m in sorted(marks, key=lambda m: m.t):
        if m.phase == "decode.defer":
            deferred[(m.worker, m.room)] = m.t
        elif m.phase == "decode.released" and m.note == "timeout":
            since = deferred.get((m.worker, m.room))
            if since is not None and m.t - since < timeout_s:
                found.append(
                    f"{m.worker} released room {m.room} ({m.rid or '?'}) by timeout {m.t - since:.2f} s after "
                    f"deferring it (its timeout: {timeout_s:g} s), with no drain ack from prefill"
                )
    return found


def writes_after_release(marks: Iterable[Mark]) -> list[str]:
    """Chunk writes of a room still running when its pages were let go: prefill sent its drain ack, or
    decode began its release, after a write of the room began and before it returned. One line each.

    Decode's release is judged at ``decode.release`` (``_do_release`` frees the pages first thing), not at
    ``decode.released``: sglang observes the outcome only after the rest of ``_do_release``, which can wait
    (a fresh clone's run: pages freed at +5.17 s, the write returned at +6.28 s, ``decode.released`` at
    +6.32 s)."""
    marks = sorted(marks, key=lambda m: m.t)
    found = []
    for i, m in enumerate(marks):
        if m.phase not in ("transfer.ack-sent", "decode.release") or m.room is None:
            continue
        started = [w for w in marks if w.phase == "transfer.write" and w.room == m.room and w.t < m.t]
        done = [w for w in marks if w.phase == "transfer.written" and w.room == m.room and w.t < m.t]
        if len(started) > len(done):
            if m.phase == "transfer.ack-sent":
                who = "prefill acked its drain"
            else:
                outcome = next(
                    (r.note for r in marks[i + 1 :] if r.phase == "decode.released" and r.worker == m.worker), "?"
                )
                who = f"decode released it ({outcome})"
            found.append(
                f"room {m.room} ({m.rid or '?'}): {who} while prefill's write of chunk "
                f"{started[len(done)].chunk} was still running"
            )
    return found


def release_outcomes(marks: Iterable[Mark]) -> dict[str, int]:
    """How decode's deferred releases ended: ``{"drained": n, "timeout": n, ...}``."""
    out: dict[str, int] = {}
    for m in marks:
        if m.phase == "decode.released":
            out[m.note or "?"] = out.get(m.note or "?", 0) + 1
    return out


def stall_story(marks: Iterable[Mark], rid: str, start: float) -> str:
    """Where each side was with a stalled request, from the trace: each side's last phase (``+T`` s from
    ``start``), and, when the room's status writes show it, why prefill never sent: a lost status update
    (decode's ``WaitingForInput`` overwritten by prefill's ``Bootstrapping``) or a lost message (decode
    sent its page list, prefill never wrote ``WaitingForInput``). Empty when the trace has no mark of it."""
    marks = list(marks)
    own = set(marks_of(marks, rid))
    rooms = {m.room for m in own if m.room is not None}
    # in trace order, then by time (a stable sort: marks of the same instant keep the order they were written)
    mine = sorted((m for m in marks if m in own or m.room in rooms), key=lambda m: m.t)
    if not mine:
        return ""
    sides = []
    for side in SIDES:
        own = [m for m in mine if PHASES.get(m.phase, ("",))[0] == side and m.phase != "transfer.status"]
        sides.append(f"{side} {own[-1].phase} at +{own[-1].t - start:.2f} s" if own else f"{side} never reached it")
    story = "; ".join(sides)
    writes = [m for m in mine if m.phase == "transfer.status" and m.note.startswith("wrote") and _on(m, "prefill")]
    waiting = [m for m in writes if m.chunk == "WaitingForInput"]
    sent = [m for m in mine if m.phase == "decode.metadata"]
    if waiting and writes[-1].note.startswith("wrote, now Bootstrapping"):
        w, last = waiting[0], writes[-1]
        return (
            f"{story}; room {last.room} stuck at Bootstrapping: a lost status update (WaitingForInput written "
            f"at +{w.t - start:.2f} s, then Bootstrapping over it at +{last.t - start:.2f} s)"
        )
    if sent and writes and not waiting:
        return (
            f"{story}; a lost message: decode sent its page list at +{sent[0].t - start:.2f} s, prefill never "
            f"wrote WaitingForInput for room {writes[-1].room}"
        )
    return story


def _on(mark: Mark, side: str) -> bool:
    """Whether a trace mark came from a worker of ``side`` (the servers' names start with it)."""
    return mark.worker.startswith(side)


class TraceTail:
    """The marks written under ``ledger_dir`` since the last :meth:`new` (each file read from where the
    previous call stopped), and the request of every room seen so far."""

    def __init__(self, ledger_dir: str | os.PathLike) -> None:
        self.dir = trace_dir(ledger_dir)
        self._at: dict[Path, int] = {}
        self.rid_of_room: dict[int, str] = {}

    def new(self) -> list[Mark]:
        out: list[Mark] = []
        for path in sorted(self.dir.glob("*.jsonl")) if self.dir.is_dir() else ():
            start = self._at.get(path, 0)
            with open(path, "rb") as f:
                f.seek(start)
                data = f.read()
            end = data.rfind(b"\n") + 1  # a line still being written is read next time
            self._at[path] = start + end
            for line in data[:end].decode("utf-8", errors="replace").splitlines():
                try:
                    mark = Mark(**json.loads(line))
                except (ValueError, TypeError):
                    continue
                if mark.rid and mark.room is not None:
                    self.rid_of_room[mark.room] = mark.rid
                out.append(mark)
        return out
