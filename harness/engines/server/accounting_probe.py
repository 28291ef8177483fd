"""Accounting probe: records the KV pages a real sglang server takes and returns, without changing it.

Enabled in a server process by ``HARNESS_PROBE_LEDGER`` (and ``HARNESS_PROBE_WORKER``,
``HARNESS_PROBE_COMPONENT``): the servers' ``sitecustomize`` calls :func:`install_from_env`, which wraps
sglang's prealloc, SWA eviction, release and flush paths at import time and writes one ledger event per call.
"Held" is read from the real state, never computed, so the ledger checker can catch a real leak; a field it
cannot read is named in the event's ``note``. What each wrapper records: docs/modules.md.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from types import ModuleType
from typing import Any, Callable

from harness.changes import measure
from harness.targets.sglang.compat.reqkv import req_kv
from harness.engines.server.hooks import after_import
from harness.engines.server import resources
from harness.engines.server.probe_read import (
    FULL,
    SWA,
    ProbeReadError,
    as_pages,
    config_of,
    diff,
    evicted_seqlen,
    free_sizes,
    freed_spans,
    held,
    pages_of,
    swa_page_row,
    unreadable,
)

log = logging.getLogger(__name__)

LEDGER_ENV = "HARNESS_PROBE_LEDGER"
WORKER_ENV = "HARNESS_PROBE_WORKER"
COMPONENT_ENV = "HARNESS_PROBE_COMPONENT"


class Probe:
    """Per-process probe state: the ledger writer and the pages each live request is known to hold."""

    def __init__(self, ledger_path: str, worker: str, component: str) -> None:
        self.ledger_path = ledger_path
        self.worker = worker
        self.component = component
        self._writer = None
        self._lock = threading.Lock()
        self.known: dict[str, dict[str, set[int]]] = {}
        self.config: Any = None  # the LedgerConfig last written
        self.reserved: dict[str, dict[str, int]] = {}  # rid -> what admission last charged it (full, swa)
        self.released: list[Any] | None = None  # SWA page ids freed inside the _evict_swa call running
        self.pending: list[Callable[[], None]] | None = None  # evict records waiting for their free group's end
        # A TP rank other than its attention group's first: its pools mirror rank 0's (the same scheduling
        # decisions on its own slice of the heads), so only rank 0 of a server of TP > 1 writes the ledger.
        self.mirror = False

    def record(self, kind: str, rid: str, page_size: int, **fields: Any) -> None:
        from harness.ledger import LedgerWriter

        if self.mirror:
            return
        with self._lock:
            if self._writer is None:
                self._writer = LedgerWriter(self.ledger_path, self.worker, self.component)
        self._writer.record(kind, str(rid), page_size, **fields)


def _wrap_prealloc(probe: Probe, orig: Callable) -> Callable:
    @functools.wraps(orig)
    def wrapper(allocator, *args, **kwargs):
        req = kwargs.get("req")
        before = free_sizes(allocator)
        try:
            kv_loc = orig(allocator, *args, **kwargs)
        except BaseException:
            probe.record(
                "alloc_fail",
                getattr(req, "rid", "?"),
                allocator.page_size,
                fill_len=kwargs.get("fill_len"),
                free_before=before,
                free_after=free_sizes(allocator),
                note=orig.__name__,
            )
            raise
        if req is None or kv_loc is None:
            return kv_loc
        uses_tail = bool(kwargs.get("uses_swa_tail"))
        taken = pages_of(allocator, kv_loc)
        probe.known[str(req.rid)] = {pool: set(p) for pool, p in taken.items()}
        note, evicted = orig.__name__, None
        if uses_tail:
            try:
                evicted = evicted_seqlen(req)
            except ProbeReadError as e:
                note = unreadable(e)
        probe.record(
            "prealloc",
            req.rid,
            allocator.page_size,
            reserved=probe.reserved.pop(str(req.rid), {}),
            fill_len=kwargs.get("fill_len"),
            swa_tail_len=kwargs.get("swa_tail_len") if uses_tail else None,
            evicted_seqlen=evicted,
            prefix_len=kwargs.get("prefix_len"),
            pages=as_pages(taken),
            free_before=before,
            free_after=free_sizes(allocator),
            note=note,
        )
        return kv_loc

    return wrapper


def _wrap_required_tokens(probe: Probe, orig: Callable) -> Callable:
    """``DecodePreallocQueue._prealloc_required_tokens``: what admission charges a request (full and SWA
    tokens, its decode reserve included), kept for the request's next ``prealloc`` event (``reserved``),
    where the ledger holds it against the whole pages the prealloc takes (``reserve-short``)."""

    @functools.wraps(orig)
    def wrapper(self, req, *args, **kwargs):
        full, swa = orig(self, req, *args, **kwargs)
        with probe._lock:
            probe.reserved[str(req.rid)] = {"full": int(full), "swa": int(swa)}
        return full, swa

    return wrapper


def _allocated_len(req, default: int | None) -> int | None:
    """How many positions the request has KV slots for (``req.kv.kv_allocated_len``), at least ``default``.

    Pages gained by decoding are seen late (at the next SWA eviction or the release), so the
    ``decode_alloc`` that records them must carry the length they were allocated for, not the last
    event's: the ledger's live-span rule reads it."""
    try:
        allocated = int(req_kv(req).kv_allocated_len)
    except (AttributeError, TypeError, ValueError):
        return default
    return allocated if default is None else max(allocated, default)


def _note_growth(
    probe: Probe, rid: str, page_size: int, held: dict[str, set[int]], fill_len: int | None = None
) -> None:
    """Record as ``decode_alloc`` the pages ``rid`` holds that the probe has not seen it take
    (``fill_len``: the length they were allocated for)."""
    known = probe.known.setdefault(rid, {})
    new = diff(held, known)
    if any(new.values()):
        probe.record("decode_alloc", rid, page_size, pages=as_pages(new), fill_len=fill_len)
        for pool, p in new.items():
            known.setdefault(pool, set()).update(p)


def _wrap_evict_swa(probe: Probe, orig: Callable) -> Callable:
    @functools.wraps(orig)
    def wrapper(self, req, *args, **kwargs):
        allocator, r2t = self.token_to_kv_pool_allocator, self.req_to_token_pool
        before, row_before = held(req, allocator, r2t), swa_page_row(req, allocator, r2t)
        probe.released = []
        try:
            result = orig(self, req, *args, **kwargs)
        finally:
            released, probe.released = probe.released, None
        pre_len = args[0] if args else kwargs.get("pre_len")

        def finish() -> None:
            after = held(req, allocator, r2t)
            spans = freed_spans(row_before, swa_page_row(req, allocator, r2t), released)
            rid, page = str(req.rid), allocator.page_size
            _note_growth(
                probe, rid, page, before, _allocated_len(req, int(pre_len) + 1 if pre_len is not None else None)
            )
            freed = diff(before, after)
            note, floor = "", None
            try:
                floor = evicted_seqlen(req)
            except ProbeReadError as e:
                note = unreadable(e)
            # Every call (pages freed or not): the sequence and its floor are what the decode rules check.
            probe.record(
                "evict",
                rid,
                page,
                pages=as_pages(freed),
                evicted_seqlen=floor,
                freed_spans=spans,
                fill_len=int(pre_len) + 1 if pre_len is not None else None,
                note=note,
            )
            for pool, p in freed.items():
                probe.known.get(rid, {}).get(pool, set()).difference_update(p)

        # Inside maybe_evict_swa's free group, releases up to 0.5.18 free the pages and clear the mapping
        # only at the group's end: what the call freed is read once the group is over.
        if probe.pending is not None:
            probe.pending.append(finish)
        else:
            finish()
        return result

    return wrapper


def _wrap_maybe_evict_swa(probe: Probe, orig: Callable) -> Callable:
    """``ScheduleBatch.maybe_evict_swa``: the ``_evict_swa`` calls inside it (one free group) are recorded
    after it returns, when the group's frees have happened (:func:`_wrap_evict_swa`)."""

    @functools.wraps(orig)
    def wrapper(self, *args, **kwargs):
        probe.pending = []
        try:
            return orig(self, *args, **kwargs)
        finally:
            pending, probe.pending = probe.pending, None
            for finish in pending:
                finish()

    return wrapper


def _wrap_swa_page_free(probe: Probe, orig: Callable) -> Callable:
    """``SWATokenToKVPoolAllocator._free_swa_pages_*``: the SWA page ids a segment free hands to the
    free list (resolved at once, freed now or at the end of the free group), noted while an
    ``_evict_swa`` runs."""

    @functools.wraps(orig)
    def wrapper(self, *args, **kwargs):
        pages = orig(self, *args, **kwargs)
        if probe.released is not None and pages is not None:
            probe.released.append(pages.detach().to("cpu").long())
        return pages

    return wrapper


def _wrap_release(probe: Probe, orig: Callable) -> Callable:
    @functools.wraps(orig)
    def wrapper(req, tree_cache, *args, **kwargs):
        allocator = tree_cache.token_to_kv_pool_allocator
        holding = held(req, allocator, tree_cache.req_to_token_pool) if req_kv(req).holds_kv else {}
        allocated = _allocated_len(req, None)  # before the release resets it
        result = orig(req, tree_cache, *args, **kwargs)
        rid = str(req.rid)
        if holding or rid in probe.known:
            _note_growth(probe, rid, allocator.page_size, holding, allocated)
            probe.record("release", rid, allocator.page_size, pages=as_pages(holding), note=_abort_note(req))
            probe.known.pop(rid, None)
        return result

    return wrapper


def _abort_note(req: Any) -> str:
    """``abort: <sglang's message>`` for a request sglang aborted (a failed or timed-out transfer, a
    client abort), else empty: a release's note, so a test can prove which failure freed the request."""
    reason = getattr(req, "finished_reason", None)
    if type(reason).__name__ != "FINISH_ABORT":
        return ""
    return f"abort: {getattr(reason, 'message', '')}"[:300]


def _wrap_pre_alloc_method(probe: Probe, orig: Callable) -> Callable:
    @functools.wraps(orig)
    def wrapper(self, *args, **kwargs):
        # The configuration lives on the queue and its scheduler, which the module-level prealloc
        # functions never see: write it once (and again if it ever changes) before the first prealloc.
        from harness.ledger import CONFIG_RID, config_event

        try:
            config = config_of(self)
        except ProbeReadError as e:
            if probe.config is None:
                probe.record("config", CONFIG_RID, 0, note=unreadable(e))
                probe.config = False
        else:
            if config != probe.config:
                probe.record("config", CONFIG_RID, config.page_size, **config_event(config))
                probe.config = config
        return orig(self, *args, **kwargs)

    return wrapper


def _idle_sizes(scheduler) -> dict[str, int]:
    """Per pool, free slots plus the slots the cache holds (what an idle server can get back)."""
    allocator, cache = scheduler.token_to_kv_pool_allocator, scheduler.tree_cache
    sizes = free_sizes(allocator)
    if SWA in sizes and hasattr(cache, "full_evictable_size"):
        sizes[FULL] += int(cache.full_evictable_size())
        sizes[SWA] += int(cache.swa_evictable_size())
    else:
        sizes[FULL] += int(cache.evictable_size())
    sizes["req_slots"] = len(scheduler.req_to_token_pool.free_slots)
    return sizes


def _wrap_flush(probe: Probe, orig: Callable) -> Callable:
    @functools.wraps(orig)
    def wrapper(self, *args, **kwargs):
        before = {**_idle_sizes(self), **resources.read(self, probe.component).values}
        ok = orig(self, *args, **kwargs)
        if ok:
            after = free_sizes(self.token_to_kv_pool_allocator)
            held = resources.read(self, probe.component)  # request rows, metadata slots, locks, rooms …
            probe.record(
                "reset",
                "<flush>",
                self.token_to_kv_pool_allocator.page_size,
                free_before=before,
                free_after={**after, **held.values},
                baseline=held.baseline,
                note="flush_cache" + resources.note(held),
            )
        # A measured run (rerun-test --coverage) keeps what this scheduler ran so far: its server
        # SIGKILLs it at shutdown, before any exit handler could save it (so it is partly measured).
        measure.save_running(partial=True)
        return ok

    return wrapper


def _wrap_scheduler_init(probe: Probe, orig: Callable, parallel: Callable[[], Any] | None) -> Callable:
    """Marks the probe of a scheduler that is not its attention TP group's rank 0 as a mirror (no ledger).
    ``parallel``: the scheduler module's ``get_parallel`` (0.5.23 keeps the ranks in its runtime context;
    releases before it, on the scheduler)."""

    @functools.wraps(orig)
    def wrapper(self, *args, **kwargs):
        orig(self, *args, **kwargs)
        where = parallel() if parallel is not None else self
        probe.mirror = getattr(where, "attn_tp_rank", getattr(where, "tp_rank", 0)) != 0

    return wrapper


def install(ledger_path: str, worker: str, component: str) -> Probe:
    """Wrap sglang's prealloc, SWA-evict and release paths (``decode`` only) and its cache flush to
    write events to ``ledger_path``.

    Args:
        ledger_path: the ledger file (``<run_dir>/ledger/<worker>.jsonl``).
        worker: worker name written in every event.
        component: ``prefill`` or ``decode``.

    Returns:
        The process's :class:`Probe`.
    """
    probe = Probe(ledger_path, worker, component)

    def on_decode(mod: ModuleType) -> None:
        mod.alloc_for_decode_prealloc = _wrap_prealloc(probe, mod.alloc_for_decode_prealloc)
        mod.alloc_for_decode_prealloc_hisparse = _wrap_prealloc(probe, mod.alloc_for_decode_prealloc_hisparse)
        queue = mod.DecodePreallocQueue
        queue._pre_alloc = _wrap_pre_alloc_method(probe, queue._pre_alloc)
        if hasattr(queue, "_prealloc_required_tokens"):
            queue._prealloc_required_tokens = _wrap_required_tokens(probe, queue._prealloc_required_tokens)

    def on_schedule_batch(mod: ModuleType) -> None:
        mod.ScheduleBatch._evict_swa = _wrap_evict_swa(probe, mod.ScheduleBatch._evict_swa)
        if hasattr(mod.ScheduleBatch, "maybe_evict_swa"):
            mod.ScheduleBatch.maybe_evict_swa = _wrap_maybe_evict_swa(probe, mod.ScheduleBatch.maybe_evict_swa)

    def on_swa_allocator(mod: ModuleType) -> None:
        cls = mod.SWATokenToKVPoolAllocator
        for name in ("_free_swa_pages_none_cuda", "_free_swa_pages_cuda"):  # the CPU and the CUDA path
            if hasattr(cls, name):
                setattr(cls, name, _wrap_swa_page_free(probe, getattr(cls, name)))

    def on_common(mod: ModuleType) -> None:
        mod.release_kv_cache = _wrap_release(probe, mod.release_kv_cache)

    def on_scheduler(mod: ModuleType) -> None:
        mod.Scheduler.flush_cache = _wrap_flush(probe, mod.Scheduler.flush_cache)
        mod.Scheduler.__init__ = _wrap_scheduler_init(probe, mod.Scheduler.__init__, getattr(mod, "get_parallel", None))

    if component == "decode":
        after_import("sglang.srt.mem_cache.common", on_common)
        after_import("sglang.srt.managers.schedule_batch", on_schedule_batch)
        after_import("sglang.srt.mem_cache.allocator.swa", on_swa_allocator)
        after_import("sglang.srt.disaggregation.decode", on_decode)
    after_import("sglang.srt.managers.scheduler", on_scheduler)
    log.info("accounting probe installed in pid %d: worker %s (%s) -> %s", os.getpid(), worker, component, ledger_path)
    return probe


def install_from_env(environ: dict | None = None) -> Probe | None:
    """Install the probe when ``HARNESS_PROBE_LEDGER`` is set; otherwise do nothing.

    Returns:
        The probe, or None when not enabled.
    """
    env = os.environ if environ is None else environ
    path = env.get(LEDGER_ENV)
    if not path:
        return None
    return install(path, env.get(WORKER_ENV, "server"), env.get(COMPONENT_ENV, "decode"))
