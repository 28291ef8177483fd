"""The phases of :mod:`harness.engines.phases` inside a real sglang server: each writes a trace line and
waits while a hold file names it, so a test reaches any phase deterministically (no sleeps, no luck).

Installed by the probe's ``sitecustomize`` in both servers; it wraps sglang's own methods at import time
(:func:`harness.engines.server.hooks.after_import`) and changes nothing else. It also traces every write
of a room's status with what it read first, which tells a lost message from a lost update. Own code, not a
library: the waits sit inside sglang's scheduler and bootstrap threads. Hook points: docs/modules.md.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

from harness.engines import phases
from harness.engines.server import races
from harness.engines.server.hooks import after_import

log = logging.getLogger(__name__)


class Points:
    """One server process's phase points: its trace file, its hold directory, and the rooms it has
    seen (a transfer-engine message names a room; the trace names its request too)."""

    def __init__(self, ledger_path: str, worker: str, side: str | None = None) -> None:
        ledger_dir = Path(ledger_path).parent
        self.holds = phases.hold_dir(ledger_dir)
        trace = phases.trace_dir(ledger_dir)
        trace.mkdir(parents=True, exist_ok=True)
        self.worker = worker
        self.side = side if side in phases.SIDES else None
        self._path = trace / f"{worker}-{os.getpid()}.jsonl"
        self._lock = threading.Lock()
        self.rid_of_room: dict[int, str] = {}
        self.chunks: dict[str, int] = {}
        self.forwards: dict[str, int] = {}  # rid -> prefill forwards (chunks) its batches ran
        self.sent: set[int] = set()
        self.written: dict[int, int] = {}  # room -> chunks its transfer workers took
        self.waiting_at: dict[int, float] = {}  # room -> when WaitingForInput was last written
        self.resurrected: set[int] = set()  # rooms traced put back after their clear (races.py)
        self.local = threading.local()

    def mark(
        self,
        phase: str,
        rid: str = "",
        room: Any = None,
        chunk: int | str | None = None,
        note: str = "",
        *,
        hold: bool = True,
    ) -> str | None:
        """Trace ``phase`` and, unless ``hold`` is False, wait while a hold names it (by request or room;
        for ``chunk`` (a chunk's index, a status's name) or any). Returns :data:`phases.DROP` when a
        dropping hold names it (the caller loses its message), else None."""
        room = int(room) if isinstance(room, int) else None
        if room is not None and rid:
            self.rid_of_room[room] = rid
        elif room is not None:
            rid = self.rid_of_room.get(room, "")
        line = phases.Mark(time.time(), self.worker, phase, rid, room, chunk, note).to_json()
        with self._lock, open(self._path, "a", encoding="utf-8") as f:
            f.write(line + "\n")
        if not hold:
            return None
        keys = [k for k in (rid, phases.room_key(room) if room is not None else "") if k]
        sides = (self.side, None) if self.side else (None,)
        chunks = (chunk, None) if chunk is not None else (None,)
        names = [phases.hold_name(phase, k, c, s) for k in keys if _plain(k) for c in chunks for s in sides]
        got = phases.wait_at_hold(
            self.holds,
            names,
            lambda n: log.info("holding at %s (remove its file to go on)", n),
            droppable=phase in phases.DROPPABLE,
        )
        if got == phases.DROP:
            log.warning("hold at %s for %s: its message is dropped (a planted loss)", phase, rid)
            return phases.DROP
        if got is not None:
            log.info("hold %s released", got)
        return None


def _plain(key: str) -> bool:
    try:
        phases.hold_name("prefill.send", key)
    except phases.PhaseError:
        return False
    return True


def _room(req: Any) -> Any:
    return getattr(req, "bootstrap_room", None)


def _wrap(orig: Callable, before: Callable | None = None, after: Callable | None = None) -> Callable:
    @functools.wraps(orig)
    def wrapper(*args, **kwargs):
        if before is not None:
            before(*args, **kwargs)
        out = orig(*args, **kwargs)
        if after is not None:
            after(out, *args, **kwargs)
        return out

    return wrapper


def _metadata_point(points: Points, orig: Callable) -> Callable:
    """``decode.metadata``: trace and hold; under a dropping hold, sglang's own step runs whole (its metadata
    slot, its counters) but the message itself is lost: the request's KV receiver sends nothing."""

    @functools.wraps(orig)
    def send(self, dr, *args, **kwargs):
        rid, room = dr.req.rid, _room(dr.req)
        if points.mark("decode.metadata", rid, room) != phases.DROP:
            return orig(self, dr, *args, **kwargs)
        receiver = dr.kv_receiver
        receiver.send_metadata = lambda *a, **k: points.mark("decode.metadata", rid, room, note="dropped", hold=False)
        try:
            return orig(self, dr, *args, **kwargs)
        finally:
            del receiver.send_metadata

    return send


def _install_prefill(points: Points, mod: ModuleType) -> None:
    mixin = mod.SchedulerDisaggregationPrefillMixin

    def send(self, req, *args, **kwargs):
        i = points.chunks.get(req.rid, 0)
        points.chunks[req.rid] = i + 1
        points.mark("prefill.send", req.rid, _room(req), chunk=i)

    mixin.send_kv_chunk = _wrap(mixin.send_kv_chunk, before=send)

    def forwarded(self, batch, *args, **kwargs):
        for req in getattr(batch, "reqs", None) or ():
            i = points.forwards.get(req.rid, 0)
            points.forwards[req.rid] = i + 1
            points.mark("prefill.forwarded", req.rid, _room(req), chunk=i)

    mixin.process_batch_result_disagg_prefill = _wrap(mixin.process_batch_result_disagg_prefill, before=forwarded)
    release = mod.release_kv_cache

    def released(req, *args, **kwargs):
        points.chunks.pop(getattr(req, "rid", ""), None)
        points.forwards.pop(getattr(req, "rid", ""), None)
        points.mark("prefill.release", getattr(req, "rid", ""), _room(req))

    mod.release_kv_cache = _wrap(release, before=released)


def _install_decode(points: Points, mod: ModuleType) -> None:
    queue, transfer = mod.DecodePreallocQueue, mod.DecodeTransferQueue

    def wrap(cls: type, name: str, **hooks: Callable) -> None:
        # A step a release lacks has no point there: the metadata send and the deferred release are
        # absent in 0.5.18, the deferred release's observer in 0.5.21 (first in 0.5.22).
        if hasattr(cls, name):
            setattr(cls, name, _wrap(getattr(cls, name), **hooks))

    wrap(queue, "_pre_alloc", after=lambda out, self, req, *a, **k: points.mark("decode.prealloc", req.rid, _room(req)))
    if hasattr(queue, "_send_kv_metadata"):
        queue._send_kv_metadata = _metadata_point(points, queue._send_kv_metadata)
    wrap(
        transfer,
        "_commit_transfer_to_req",
        before=lambda self, dr, *a, **k: points.mark("decode.transferred", dr.req.rid, _room(dr.req)),
        after=lambda out, self, dr, *a, **k: points.mark("decode.commit", dr.req.rid, _room(dr.req)),
    )
    wrap(
        transfer,
        "_defer_release",
        before=lambda self, dr, *a, **k: points.mark("decode.defer", dr.req.rid, _room(dr.req)),
    )

    def release(self, dr, *args, **kwargs):
        points.local.last = (dr.req.rid, _room(dr.req))
        points.mark("decode.release", dr.req.rid, _room(dr.req))

    wrap(transfer, "_do_release", before=release)

    def observed(self, *args, outcome="", **kwargs):
        outcome = outcome or (args[-1] if len(args) >= 2 else "")
        rid, room = getattr(points.local, "last", ("", None))
        points.mark("decode.released", rid, room, note=str(outcome))

    wrap(transfer, "_observe_deferred_kv_release", before=observed)


class _StatusTable(dict):
    """sglang's ``request_status`` with one seam: a status write in progress may hold between its read
    and its write (the ``transfer.status`` hold), so a test can force two writers to interleave there."""

    points: Points

    def get(self, room, default=None):  # type: ignore[override]
        value = super().get(room, default)
        writing = getattr(self.points.local, "writing", None)
        if writing is not None and writing[0] == room:
            self.points.local.read = (value, time.time())
            self.points.mark(
                "transfer.status", room=room, chunk=_name(writing[1]), note=f"read {_name(value)}, writing"
            )
        return value


#: sglang's ``KVPoll`` values (plain ints in 0.5.23).
_STATUS = {0: "Failed", 1: "Bootstrapping", 2: "WaitingForInput", 3: "Transferring", 4: "Success"}


def _name(status: Any) -> str:
    if isinstance(status, int) and not isinstance(status, bool):
        return _STATUS.get(status, str(status))
    return getattr(status, "name", str(status))


def _lost_update(points: Points, room: int, status: Any, read: Any, after: Any) -> None:
    """Trace ``transfer.lost-update`` the moment a write replaced another thread's ``WaitingForInput``
    that landed between its read and its write (the harness then need not wait for a client's timeout)."""
    name = _name(status)
    if name == "WaitingForInput":
        points.waiting_at[room] = time.time()
        if len(points.waiting_at) > 100_000:
            points.waiting_at.clear()
        return
    if read is None or name != "Bootstrapping" or _name(after) != "Bootstrapping":
        return
    value, read_at = read
    if value is None and points.waiting_at.get(room, 0.0) > read_at:
        points.mark("transfer.lost-update", room=room, note="WaitingForInput written over by Bootstrapping", hold=False)


def _resurrected(points: Points, room: int, status: Any, after: Any) -> None:
    """Trace ``transfer.resurrected`` the moment a status write left a room in prefill's KV manager that its
    sender had cleared and no sender holds (:mod:`harness.engines.server.races`: nothing clears it again)."""
    cleared = races.cleared_at(room)
    if after is None or cleared is None or races.owned(room) or room in points.resurrected:
        return
    points.resurrected.add(room)
    if len(points.resurrected) > 100_000:
        points.resurrected.clear()
    points.mark(
        "transfer.resurrected",
        room=room,
        note=f"a {_name(status)} write ({threading.current_thread().name}) put it back "
        f"{time.time() - cleared:.3f} s after its sender cleared it",
        hold=False,
    )


def watch_status(manager: Any, points: Points) -> None:
    """Give a KV manager the status table with the ``transfer.status`` seam (a plain dict only: a
    pipeline-parallel consensus store is left as it is)."""
    if type(manager.request_status) is dict:
        table = _StatusTable(manager.request_status)
        table.points = points
        manager.request_status = table


def write_status(points: Points, manager: Any, room: Any, status: Any, update: Callable) -> Any:
    """sglang's ``update_status`` (``update``) as the points run it: the write says it is running (the
    ``transfer.status`` seam reads that), then its trace line, and the two races' marks where it made one."""
    points.local.writing = (room, status)
    try:
        return update(manager, room, status)
    finally:
        points.local.writing = None
        read, points.local.read = getattr(points.local, "read", None), None
        if isinstance(room, int):
            table = manager.request_status
            after = dict.get(table, room) if isinstance(table, dict) else None
            points.mark(
                "transfer.status",
                room=room,
                chunk=_name(status),
                note=f"wrote, now {_name(after)} ({threading.current_thread().name})",
                hold=False,
            )
            _lost_update(points, room, status, read, after)
            _resurrected(points, room, status, after)


def note_opened(sender: Any) -> None:
    """After prefill's scheduler opened a sender for a room (``CommonKVSender.__init__``): tell :mod:`races`."""
    room = getattr(sender, "bootstrap_room", None)
    if isinstance(room, int):
        races.note_opened(room)


def note_cleared(points: Points, sender: Any) -> None:
    """After prefill's sender cleared its room (``CommonKVSender.clear``): tell :mod:`races`, and trace it."""
    room = getattr(sender, "bootstrap_room", None)
    if isinstance(room, int):
        races.note_cleared(room)
        points.resurrected.discard(room)
        points.mark("prefill.cleared", room=room, note=_name(getattr(sender, "conclude_state", None)))


def _install_status(points: Points, mod: ModuleType) -> None:
    manager = mod.CommonKVManager
    orig_init, orig_update = manager.__init__, manager.update_status

    @functools.wraps(orig_init)
    def init(self, *args, **kwargs):
        orig_init(self, *args, **kwargs)
        watch_status(self, points)

    @functools.wraps(orig_update)
    def update(self, bootstrap_room, status):
        return write_status(points, self, bootstrap_room, status, orig_update)

    manager.__init__ = init
    manager.update_status = update

    sender = getattr(mod, "CommonKVSender", None)  # a release without it: no sender seen, no room read apart
    if sender is not None and hasattr(sender, "clear"):
        sender.__init__ = _wrap(sender.__init__, after=lambda out, self, *a, **k: note_opened(self))
        sender.clear = _wrap(sender.clear, after=lambda out, self, *a, **k: note_cleared(points, self))
        races.watch()

    if points.side == "prefill" and hasattr(manager, "register_to_bootstrap"):
        manager.register_to_bootstrap = _wrap(
            manager.register_to_bootstrap, before=lambda self, *a, **k: points.mark("prefill.register", points.worker)
        )
    if points.side == "decode" and hasattr(manager, "try_ensure_parallel_info"):
        manager.try_ensure_parallel_info = _prefill_info_point(points, manager.try_ensure_parallel_info)

    def ack(self, bootstrap_room, prefill_rank, *args, **kwargs):
        points.mark("transfer.ack", room=bootstrap_room, note=f"prefill rank {prefill_rank}")

    if hasattr(manager, "note_abort_ack"):  # drain acks: absent in 0.5.18 (nothing to mark there)
        manager.note_abort_ack = _wrap(manager.note_abort_ack, before=ack)
    if hasattr(manager, "_send_abort_ack"):
        manager._send_abort_ack = _wrap(
            manager._send_abort_ack, before=lambda self, room, *a, **k: points.mark("transfer.ack-sent", room=room)
        )


def _prefill_info_point(points: Points, orig: Callable) -> Callable:
    """Trace each answer decode gets for a bootstrap address it has no parallel info of yet (a cached
    address is answered from the table, every scheduling cycle, and not traced)."""

    @functools.wraps(orig)
    def ensure(self, bootstrap_addr, *args, **kwargs):
        if bootstrap_addr in getattr(self, "prefill_info_table", {}):
            return orig(self, bootstrap_addr, *args, **kwargs)
        ready = orig(self, bootstrap_addr, *args, **kwargs)
        points.mark("decode.prefill-info", note=f"{bootstrap_addr} {'ready' if ready else 'not ready'}", hold=False)
        return ready

    return ensure


def _install_mooncake(points: Points, mod: ModuleType) -> None:
    manager = mod.MooncakeKVManager
    orig = getattr(manager, "_handle_abort_notification", None)  # abort notices: first in 0.5.22

    @functools.wraps(orig)
    def on_abort(self, msg):
        out = orig(self, msg)
        if msg and msg[0] == mod.ABORT_TAG:
            note = mod.AbortNotification.from_zmq(msg)
            if note is not None:
                points.mark("transfer.abort", room=note.room)
        return out

    if orig is not None:
        manager._handle_abort_notification = on_abort
    for name in ("send_kvcache", "send_kvcache_slice", "send_kvcache_dcp"):
        if hasattr(manager, name):
            setattr(manager, name, _wrap_write(points, getattr(manager, name)))
    sender = mod.MooncakeKVSender
    orig_poll = sender.poll

    @functools.wraps(orig_poll)
    def poll(self):
        out = orig_poll(self)
        room = getattr(self, "bootstrap_room", None)
        if _name(out) == "Success" and isinstance(room, int) and room not in points.sent:
            points.sent.add(room)
            if len(points.sent) > 100_000:
                points.sent.clear()
            points.mark("prefill.sent", room=room)
        return out

    sender.poll = poll


def _wrap_write(points: Points, orig: Callable) -> Callable:
    @functools.wraps(orig)
    def write(*args, **kwargs):
        room, chunk = getattr(points.local, "chunk", (None, None))
        points.mark("transfer.write", room=room, chunk=chunk)
        try:
            return orig(*args, **kwargs)
        finally:
            points.mark("transfer.written", room=room, chunk=chunk, hold=False)

    return write


def _install_queue(points: Points, mod: ModuleType) -> None:
    """The transfer worker's chunk, remembered per thread as it leaves its queue: the write it then
    makes (``send_kvcache``) does not say which room it serves."""
    queue = mod.FastQueue
    orig = queue.get

    @functools.wraps(orig)
    def get(self, *args, **kwargs):
        item = orig(self, *args, **kwargs)
        room = getattr(item, "room", None)
        if isinstance(room, int):
            seen = points.written.get(room, 0)
            if len(points.written) > 100_000:
                points.written.clear()
            points.written[room] = seen + 1
            points.local.chunk = (room, seen)
        return item

    queue.get = get


def install(ledger_path: str, worker: str, component: str) -> Points:
    """Install the phase points of ``component`` (prefill or decode) in this server process."""
    points = Points(ledger_path, worker, component)
    if component == "prefill":
        after_import("sglang.srt.disaggregation.prefill", lambda m: _install_prefill(points, m))
        after_import("sglang.srt.disaggregation.common.utils", lambda m: _install_queue(points, m))
    else:
        after_import("sglang.srt.disaggregation.decode", lambda m: _install_decode(points, m))
    after_import("sglang.srt.disaggregation.common.conn", lambda m: _install_status(points, m))
    after_import("sglang.srt.disaggregation.mooncake.conn", lambda m: _install_mooncake(points, m))
    return points


def install_from_env(environ: dict | None = None) -> bool:
    """Install in a server started with the probe; True when installed."""
    from harness.engines.server.accounting_probe import COMPONENT_ENV, LEDGER_ENV, WORKER_ENV

    env = os.environ if environ is None else environ
    if not env.get(LEDGER_ENV) or env.get(COMPONENT_ENV) not in ("prefill", "decode"):
        return False
    install(env[LEDGER_ENV], env.get(WORKER_ENV) or env[COMPONENT_ENV], env[COMPONENT_ENV])
    return True
