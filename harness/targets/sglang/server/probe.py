"""Accounting probe: records the KV pages a real sglang server takes and returns, without changing it.

Enabled in a server process by env var (the launcher sets them when given a run directory)::

    HARNESS_PROBE_LEDGER=<run_dir>/ledger/<worker>.jsonl
    HARNESS_PROBE_WORKER=<worker>       HARNESS_PROBE_COMPONENT=prefill|decode

The ``sitecustomize`` on the servers' PYTHONPATH calls :func:`install_from_env`, which wraps, at
import time (:mod:`.hooks`):

* ``decode.alloc_for_decode_prealloc`` and ``decode.alloc_for_decode_prealloc_hisparse`` — one
  ``prealloc`` event: rid, fill_len, swa_tail_len, the SWA floor sglang recorded on the request
  (``evicted_seqlen``), page size, window, the page ids taken per pool (read from the returned
  ``kv_loc`` and the full→SWA mapping), and each pool's free size before and after;
* ``ScheduleBatch._evict_swa`` (the SWA sliding-window free path) — one ``evict`` event with the SWA
  pages the request stopped holding, and a ``decode_alloc`` event for pages it gained by decoding
  since the last event;
* ``mem_cache.common.release_kv_cache`` — one ``release`` event with every page the request still
  held (and a ``decode_alloc`` for pages gained since the last event);
* ``Scheduler.flush_cache`` (sglang's ``/flush_cache``, how the harness resets a shared server
  between tests) — one ``reset`` event when the flush ran: per pool (``full``, ``swa``,
  ``req_slots``) the free size plus what the cache held just before, and the free size after, so
  the ledger's ``reset-leak`` rule sees a slot that was neither free nor cached (a leak the flush's
  ``clear()`` would otherwise hide).

The decode paths are wrapped only in a ``decode`` probe; the flush is wrapped in every probe (a
``prefill`` probe writes ``reset`` events only).

Before its first prealloc event the probe writes a ``config`` event (:class:`harness.ledger.LedgerConfig`)
from the server's configuration — page size, the scheduler's ``sliding_window_size``, the decode
radix-cache flag, the SWA-tail pool, ``SGLANG_SWA_EVICTION_INTERVAL``, the hisparse host page and
compression — so the ledger checker derives the exact tail, charge and decode-window bounds itself.
Every ``_evict_swa`` call records the request's sequence length and SWA floor (``evict``, pages
possibly empty), so the decode rules see the floor even when nothing was freed.

A field the probe cannot read is never silently ``None``: the event it belongs to carries
``note="unreadable: <field> (<error>)"``, which the ledger reports as ``probe-unreadable``, failing
the suite that checks the ledger with what could not be read.

"Held" is read from the real state before and after each call (the request's ``req_to_token`` row
and the allocator's full→SWA mapping), never computed from a formula, so the ledger checker
(:func:`harness.ledger.check`) can catch a real leak or an over-window SWA tail. Every wrapper calls
the original with the same arguments and returns its result unchanged; an exception from the
original propagates after an ``alloc_fail`` event is written. Events are appended with
:class:`harness.ledger.LedgerWriter`, created on the first event so only the scheduler process
(the one that allocates) writes the file.

Why one module of more than 400 lines: this docstring is a sixth of it, and the wrappers are one
probe: each reads the same request and allocator state before and after the call it wraps, and
writes through the same writer.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from types import ModuleType
from typing import Any, Callable

from harness.changes import measure
from harness.targets.sglang.server.hooks import after_import

log = logging.getLogger(__name__)

LEDGER_ENV = "HARNESS_PROBE_LEDGER"
WORKER_ENV = "HARNESS_PROBE_WORKER"
COMPONENT_ENV = "HARNESS_PROBE_COMPONENT"

FULL, SWA = "full", "swa"


class ProbeReadError(Exception):
    """The probe could not read a field of sglang's state (named in the message)."""

    def __init__(self, field: str, cause: BaseException | str):
        super().__init__(f"{field} ({cause!r})" if isinstance(cause, BaseException) else f"{field} ({cause})")
        self.field = field


def unreadable(error: ProbeReadError) -> str:
    """The ``note`` of an event a field of which could not be read."""
    from harness.ledger import UNREADABLE

    return f"{UNREADABLE} {error}"


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

    def record(self, kind: str, rid: str, page_size: int, **fields: Any) -> None:
        from harness.ledger import LedgerWriter

        with self._lock:
            if self._writer is None:
                self._writer = LedgerWriter(self.ledger_path, self.worker, self.component)
        self._writer.record(kind, str(rid), page_size, **fields)


# --------------------------------------------------------------------------------------------
# reading real state
# --------------------------------------------------------------------------------------------


def _free_sizes(allocator) -> dict[str, int]:
    if hasattr(allocator, "full_available_size") and hasattr(allocator, "swa_available_size"):
        return {FULL: int(allocator.full_available_size()), SWA: int(allocator.swa_available_size())}
    return {FULL: int(allocator.available_size())}


def _pages_of(allocator, full_slots) -> dict[str, set[int]]:
    """Page ids per pool behind ``full_slots`` (slot 0 is sglang's padding slot, never a real page)."""
    page = allocator.page_size
    slots = full_slots.to("cpu").long()
    out = {FULL: {int(p) for p in (slots[slots > 0] // page).unique().tolist()}}
    mapping = getattr(allocator, "full_to_swa_index_mapping", None)
    if mapping is not None:
        swa = mapping[slots.to(mapping.device)].to("cpu").long()
        out[SWA] = {int(p) for p in (swa[swa > 0] // page).unique().tolist()}
    return out


def _held(req, allocator, req_to_token_pool) -> dict[str, set[int]]:
    """Pages the request holds now: its ``req_to_token`` row up to its allocated length."""
    idx = getattr(req.kv, "req_pool_idx", None)
    n = int(getattr(req.kv, "kv_allocated_len", 0) or 0)
    if idx is None or n <= 0 or req_to_token_pool is None:
        return {}
    return _pages_of(allocator, req_to_token_pool.req_to_token[idx, :n])


def _evicted_seqlen(req) -> int:
    """The request's SWA floor, as sglang recorded it.

    Raises:
        ProbeReadError: the floor cannot be read (never a silent None).
    """
    try:
        from sglang.srt.mem_cache.unified_cache.component_type import ComponentType  # noqa: PLC0415

        return int(req.kv.get_evicted_seqlen(ComponentType.SWA))
    except Exception as e:  # noqa: BLE001 - named in the event, reported by the ledger
        raise ProbeReadError("evicted_seqlen (req.kv.get_evicted_seqlen(SWA))", e) from None


def _config_of(queue) -> Any:
    """The :class:`harness.ledger.LedgerConfig` of a decode prealloc queue's server configuration.

    Raises:
        ProbeReadError: a configuration field cannot be read.
    """
    from harness.ledger import LedgerConfig

    def read(field: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - named in the event, reported by the ledger
            raise ProbeReadError(field, e) from None

    allocator = queue.token_to_kv_pool_allocator
    page = int(read("page_size", lambda: allocator.page_size))
    window = read("scheduler.sliding_window_size", lambda: queue.scheduler.sliding_window_size) or None
    radix = bool(read("disaggregation_decode_enable_radix_cache", _decode_radix_cache))
    # The SWA-tail pool is configuration (hybrid-SWA / DeepSeek-V4 pools with pages > 1).
    swa_tail = bool(read("_uses_swa_tail_prealloc", queue._uses_swa_tail_prealloc)) and bool(window)
    interval = int(read("SGLANG_SWA_EVICTION_INTERVAL", _eviction_interval))
    reserve = int(read("num_reserved_decode_tokens", lambda: queue.num_reserved_decode_tokens))
    host_page = compression = None
    if read("scheduler.enable_hisparse", lambda: bool(getattr(queue.scheduler, "enable_hisparse", False))):
        host_page = int(read("hisparse_page_size", lambda: allocator.hisparse_page_size))
        coordinator = read("scheduler.hisparse_coordinator", lambda: queue.scheduler.hisparse_coordinator)
        compression = int(read("hisparse compress_ratio",
                               lambda: coordinator.compress_ratio if coordinator.is_dsv4_hisparse else 1))
    return LedgerConfig(page_size=page, window=window, radix_cache=radix, swa_tail=swa_tail,
                        eviction_interval=max(1, interval), decode_reserve=reserve, swa_decode_reserve=reserve,
                        host_page=host_page, compression=compression)


def _decode_radix_cache() -> bool:
    from sglang.srt.runtime_context import get_disagg  # noqa: PLC0415

    return get_disagg().disaggregation_decode_enable_radix_cache


def _eviction_interval() -> int:
    from sglang.srt.environ import envs  # noqa: PLC0415

    return envs.SGLANG_SWA_EVICTION_INTERVAL.get()


def _as_pages(sets: dict[str, set[int]]) -> dict[str, tuple[int, ...]]:
    return {pool: tuple(sorted(p)) for pool, p in sets.items() if p}


def _diff(a: dict[str, set[int]], b: dict[str, set[int]]) -> dict[str, set[int]]:
    return {pool: a.get(pool, set()) - b.get(pool, set()) for pool in a}


# --------------------------------------------------------------------------------------------
# wrappers (each calls the original with the same arguments and returns its result)
# --------------------------------------------------------------------------------------------


def _wrap_prealloc(probe: Probe, orig: Callable) -> Callable:
    @functools.wraps(orig)
    def wrapper(allocator, *args, **kwargs):
        req = kwargs.get("req")
        before = _free_sizes(allocator)
        try:
            kv_loc = orig(allocator, *args, **kwargs)
        except BaseException:
            probe.record("alloc_fail", getattr(req, "rid", "?"), allocator.page_size,
                         fill_len=kwargs.get("fill_len"), free_before=before, free_after=_free_sizes(allocator),
                         note=orig.__name__)
            raise
        if req is None or kv_loc is None:
            return kv_loc
        uses_tail = bool(kwargs.get("uses_swa_tail"))
        taken = _pages_of(allocator, kv_loc)
        probe.known[str(req.rid)] = {pool: set(p) for pool, p in taken.items()}
        note, evicted = orig.__name__, None
        if uses_tail:
            try:
                evicted = _evicted_seqlen(req)
            except ProbeReadError as e:
                note = unreadable(e)
        probe.record(
            "prealloc", req.rid, allocator.page_size,
            fill_len=kwargs.get("fill_len"),
            swa_tail_len=kwargs.get("swa_tail_len") if uses_tail else None,
            evicted_seqlen=evicted, prefix_len=kwargs.get("prefix_len"),
            pages=_as_pages(taken), free_before=before, free_after=_free_sizes(allocator), note=note,
        )
        return kv_loc

    return wrapper


def _allocated_len(req, default: int | None) -> int | None:
    """How many positions the request has KV slots for (``req.kv.kv_allocated_len``), at least ``default``.

    Pages gained by decoding are seen late (at the next SWA eviction or the release), so the
    ``decode_alloc`` that records them must carry the length they were allocated for, not the last
    event's: the ledger's live-span rule reads it."""
    try:
        allocated = int(req.kv.kv_allocated_len)
    except (AttributeError, TypeError, ValueError):
        return default
    return allocated if default is None else max(allocated, default)


def _note_growth(probe: Probe, rid: str, page_size: int, held: dict[str, set[int]],
                 fill_len: int | None = None) -> None:
    """Record as ``decode_alloc`` the pages ``rid`` holds that the probe has not seen it take
    (``fill_len``: the length they were allocated for)."""
    known = probe.known.setdefault(rid, {})
    new = _diff(held, known)
    if any(new.values()):
        probe.record("decode_alloc", rid, page_size, pages=_as_pages(new), fill_len=fill_len)
        for pool, p in new.items():
            known.setdefault(pool, set()).update(p)


def _wrap_evict_swa(probe: Probe, orig: Callable) -> Callable:
    @functools.wraps(orig)
    def wrapper(self, req, *args, **kwargs):
        allocator, r2t = self.token_to_kv_pool_allocator, self.req_to_token_pool
        before = _held(req, allocator, r2t)
        result = orig(self, req, *args, **kwargs)
        after = _held(req, allocator, r2t)
        rid, page = str(req.rid), allocator.page_size
        pre_len = args[0] if args else kwargs.get("pre_len")
        _note_growth(probe, rid, page, before,
                     _allocated_len(req, int(pre_len) + 1 if pre_len is not None else None))
        freed = _diff(before, after)
        note, floor = "", None
        try:
            floor = _evicted_seqlen(req)
        except ProbeReadError as e:
            note = unreadable(e)
        # Every call (pages freed or not): the sequence and its floor are what the decode rules check.
        probe.record("evict", rid, page, pages=_as_pages(freed), evicted_seqlen=floor,
                     fill_len=int(pre_len) + 1 if pre_len is not None else None, note=note)
        for pool, p in freed.items():
            probe.known.get(rid, {}).get(pool, set()).difference_update(p)
        return result

    return wrapper


def _wrap_release(probe: Probe, orig: Callable) -> Callable:
    @functools.wraps(orig)
    def wrapper(req, tree_cache, *args, **kwargs):
        allocator = tree_cache.token_to_kv_pool_allocator
        held = _held(req, allocator, tree_cache.req_to_token_pool) if req.kv.holds_kv else {}
        allocated = _allocated_len(req, None)  # before the release resets it
        result = orig(req, tree_cache, *args, **kwargs)
        rid = str(req.rid)
        if held or rid in probe.known:
            _note_growth(probe, rid, allocator.page_size, held, allocated)
            probe.record("release", rid, allocator.page_size, pages=_as_pages(held))
            probe.known.pop(rid, None)
        return result

    return wrapper


def _wrap_pre_alloc_method(probe: Probe, orig: Callable) -> Callable:
    @functools.wraps(orig)
    def wrapper(self, *args, **kwargs):
        # The configuration lives on the queue and its scheduler, which the module-level prealloc
        # functions never see: write it once (and again if it ever changes) before the first prealloc.
        from harness.ledger import CONFIG_RID, config_event

        try:
            config = _config_of(self)
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
    sizes = _free_sizes(allocator)
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
        before = _idle_sizes(self)
        ok = orig(self, *args, **kwargs)
        if ok:
            after = _free_sizes(self.token_to_kv_pool_allocator)
            after["req_slots"] = len(self.req_to_token_pool.free_slots)
            probe.record("reset", "<flush>", self.token_to_kv_pool_allocator.page_size,
                         free_before=before, free_after=after, note="flush_cache")
        # A measured run (rerun-test --coverage) keeps what this scheduler ran so far: its server
        # SIGKILLs it at shutdown, before any exit handler could save it (so it is partly measured).
        measure.save_running(partial=True)
        return ok

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

    def on_schedule_batch(mod: ModuleType) -> None:
        mod.ScheduleBatch._evict_swa = _wrap_evict_swa(probe, mod.ScheduleBatch._evict_swa)

    def on_common(mod: ModuleType) -> None:
        mod.release_kv_cache = _wrap_release(probe, mod.release_kv_cache)

    def on_scheduler(mod: ModuleType) -> None:
        mod.Scheduler.flush_cache = _wrap_flush(probe, mod.Scheduler.flush_cache)

    if component == "decode":
        after_import("sglang.srt.mem_cache.common", on_common)
        after_import("sglang.srt.managers.schedule_batch", on_schedule_batch)
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
