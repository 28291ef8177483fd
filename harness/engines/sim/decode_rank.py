"""The decode worker payload: one per decode TP rank, on the real sglang decode paths.

:class:`DecodeWorker` admits a request through the real prealloc, receives and verifies its pages, runs
batched decode steps, and aborts, fails, retracts and resumes requests; every page move is a ledger event.
Why one module of more than 400 lines: it is one object, the decode rank, whose steps all read and change
the same live requests, pools and ledger books; split, each part would reach into the others' state. Its
errors are :mod:`harness.engines.sim.errors`; each operation's real path: docs/modules.md.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

import torch

from harness.ledger import spans
from harness.engines.sim import kv_content, kvfill
from harness.engines.sim.errors import KVCorruption, PreallocError, WindowLost
from harness.engines.sim.payload import RankPayload
from harness.engines.sim.prefill_rank import pick_device
from harness.engines.sim.workload import SGLANG_EVICTION_INTERVAL, KVSpec
from harness.engines.sim.tokens import prompt_ids, seeds

logger = logging.getLogger(__name__)

#: sglang's SWA eviction cadence variable; each decode rank sets it from ``KVSpec.eviction_interval``.
EVICTION_INTERVAL_ENV = "SGLANG_SWA_EVICTION_INTERVAL"


@dataclass
class _Live:
    req: Any
    group: str
    prompt_len: int
    steps_left: int
    swa_start: int = 0  # first position whose SWA pages were shipped
    prefix: int = 0  # tokens reused from the decode radix cache (their pages are the cache's)


@contextlib.contextmanager
def _eviction_interval(interval: int | None) -> Iterator[None]:
    """``SGLANG_SWA_EVICTION_INTERVAL`` for one decode step (sglang reads it at every step); None: unset,
    so sglang's default applies. Restored after, so a payload run in a test process leaves no trace."""
    before = os.environ.get(EVICTION_INTERVAL_ENV)
    if interval is None:
        os.environ.pop(EVICTION_INTERVAL_ENV, None)
    else:
        os.environ[EVICTION_INTERVAL_ENV] = str(interval)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(EVICTION_INTERVAL_ENV, None)
        else:
            os.environ[EVICTION_INTERVAL_ENV] = before


def _ceil(n: int, p: int) -> int:
    return -(-n // p) * p


class DecodeWorker(RankPayload):
    """Decode payload of one TP rank (arguments: :class:`RankPayload`'s; its component is ``decode``)."""

    def __init__(self, name: str, shard: int, spec: KVSpec, run_dir: str, tp: int = 1):
        self.live: dict[str, _Live] = {}
        self.retracted: dict[str, _Live] = {}  # retracted, their KV backed up, waiting to resume
        self.dests: dict[str, dict[str, dict[int, int]]] = {}  # rid -> pool -> {request page j: page}
        self.gone: dict[str, dict[str, dict[int, int]]] = {}  # the same of released requests
        super().__init__(name, shard, tp, run_dir, "decode", spec)

    # ---------------------------------------------------------------- set-up

    def configure(self, spec: KVSpec, discard: bool = False) -> str:
        """(Re)build the decode side for ``spec``; returns the device.

        Args:
            spec: the pool configuration.
            discard: drop requests still live (a failed test left them) instead of refusing: the
                pools are rebuilt, so nothing of them survives.

        Raises:
            RuntimeError: requests are live and ``discard`` is False.
        """
        from harness.engines.sim.decode_side import DecodeSide
        from harness.engines.sim.decode_types import DecodeConfig
        from harness.engines.sim.pd_decode_side import Dsv4DecodeSide
        from harness.engines.sim.prefill_side import page_buffers

        if discard and (self.live or self.retracted):
            logger.warning(
                "%s: discarding %d request(s) a failed run left: %s",
                self.name,
                len(self.live) + len(self.retracted),
                sorted(self.live) + sorted(self.retracted),
            )
            self.live.clear()
            self.retracted.clear()
        if self.live or self.retracted:
            raise RuntimeError(f"{self.name}: configure() with {len(self.live) + len(self.retracted)} request(s) live")
        self.spec = spec
        self.device = pick_device(spec.device)
        sizes = self.pool_sizes(spec)
        config = DecodeConfig(
            hisparse=spec.hisparse,
            page_size=spec.page_size,
            window=spec.window,
            radix_cache=spec.radix_cache,
            sizes=sizes,
            device=self.device,
            alloc_order=spec.alloc_order,
        )
        self.side = Dsv4DecodeSide(config) if spec.kind == "dsv4" and not spec.hisparse else DecodeSide(config)
        self.buffers = page_buffers(self.side.kv_pool, spec.page_size, spec.full_tokens // spec.page_size)
        self.interval = spec.eviction_interval or SGLANG_EVICTION_INTERVAL
        # SWA tokens a request may keep while decoding (the ledger's bound, new token included).
        self.retained = self.side.ledger_config(self.interval).decode_span_bound() + 1
        self.reserved: dict[str, tuple[int, int]] = {}
        self.dests.clear()
        self.gone.clear()
        self.steps = 0
        self.ledger.worker = f"{self.name}/{spec.tag}"
        self.record_config(self.side.ledger_config(self.interval), self._free())
        return self.device

    def layout(self) -> dict[str, list[int]]:
        """Bytes per page of each buffer a transfer writes (must equal the prefill side's)."""
        return {
            "full": [int(b.shape[1]) for b in self.buffers.full],
            "swa": [int(b.shape[1]) for b in self.buffers.swa],
        }

    # ---------------------------------------------------------------- helpers

    def _pages(self) -> dict[str, frozenset[int]]:
        from harness.engines.sim.prefill_side import free_pages

        return free_pages(self.side.allocator)

    def _free(self) -> dict[str, int]:
        snap = self.side.snapshot()
        return {**{k: v for k, v in snap.free().items() if k in ("full", "swa", "host")}, **snap.resources()}

    def _locs(self, live: _Live, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        from harness.engines.sim.prefill_side import token_locs

        return token_locs(self.side.req_to_token_pool, self.side.allocator, live.req, start, end)

    @staticmethod
    def _kv(req: Any) -> Any:
        from harness.targets.sglang.compat import req_kv

        return req_kv(req)

    def _evicted(self, req: Any) -> int:
        from harness.targets.sglang.compat import evicted_seqlen, req_kv

        return evicted_seqlen(req_kv(req))

    def _row(self, live: _Live) -> tuple[torch.Tensor, torch.Tensor]:
        """Full and SWA slots of the request's positions past its cached prefix (SWA slot 0 = none)."""
        return self._locs(live, live.prefix, int(self._kv(live.req).kv_allocated_len))

    def _owned(self, live: _Live, row: tuple[torch.Tensor, torch.Tensor] | None = None) -> dict[str, set[int]]:
        """Pages this request owns now (``row``: its :meth:`_row`, read now if not given): full pages past
        its cached prefix, SWA pages of its live tail."""
        P = self.spec.page_size
        full, swa = row if row is not None else self._row(live)
        ev = max(0, self._evicted(live.req) - live.prefix)
        return {"full": set((full // P).tolist()), "swa": set((swa[ev:] // P).tolist()) - {0}}

    def _record_cache_eviction(
        self, pages: Mapping[str, set[int] | frozenset[int]], free_before: dict[str, int] | None = None
    ) -> None:
        # Pages the radix cache gave back inside an allocation (sglang evicts the tree before it
        # allocates): freed by the cache, possibly handed straight to the request.
        if any(pages.values()):
            self.ledger.record(
                "evict",
                "<cache>",
                self.spec.page_size,
                pages={k: tuple(sorted(v)) for k, v in pages.items()},
                free_before=free_before or {},
                note="radix cache eviction",
            )

    def _growth(self, fill: int, tail: int, steps: int) -> tuple[int, int]:
        """The (full, SWA) tokens a request at ``fill`` (SWA tail ``tail``) reserves for ``steps`` more."""
        P = self.spec.page_size
        return _ceil(fill + steps, P) - _ceil(fill, P), max(0, _ceil(self.retained, P) - _ceil(tail, P))

    def _fits(self, fill: int, tail: int, steps: int) -> tuple[int, int] | None:
        """The (full, SWA) tokens to reserve for the request's decode growth if it fits now, else None.

        Admission as sglang's queue does it in spirit: the prefill tokens plus the growth of this
        and every running request must fit in free (and, with the radix cache, evictable) slots.
        """
        P = self.spec.page_size
        snap = self.side.snapshot()
        res_full = sum(r[0] for r in self.reserved.values())
        res_swa = sum(r[1] for r in self.reserved.values())
        grow_full, grow_swa = self._growth(fill, tail, steps)
        full_avail = snap.full + snap.tree_full_evictable - res_full
        swa_avail = snap.swa + snap.tree_swa_evictable - res_swa
        ok = snap.req_slots > 0 and full_avail >= _ceil(fill, P) + grow_full and swa_avail >= _ceil(tail, P) + grow_swa
        if ok and snap.host is not None:  # hisparse: the C4 KV lands in host slots
            ok = snap.host >= int(self.side.coordinator.host_token_len(fill + steps))
        return (grow_full, grow_swa) if ok else None

    # ---------------------------------------------------------------- operations

    def admit(self, rid: str, prompt_len: int, steps: int, group: str | None = None) -> dict[str, Any] | None:
        """Preallocate a request through ``DecodePreallocQueue._pre_alloc`` if the pools can hold it.

        Args:
            rid: request id.
            prompt_len: prompt tokens (the first output token arrives with the KV).
            steps: decode steps it will run.
            group: prefix group (default the rid).

        Returns:
            None when it must wait in the queue; else ``{"full": {request page j: page id},
            "swa": {request page j: SWA page id}}`` — the destination pages the transfer fills.

        Raises:
            PreallocError: sglang's prealloc raised (the event is in the ledger as ``alloc_fail``).
        """
        from harness.engines.sim.requests import make_req

        P = self.spec.page_size
        group = group or rid
        req = make_req(rid, prompt_len, output_len=1, max_new_tokens=steps + 1)
        req.origin_input_ids = prompt_ids(group, prompt_len)
        fill = self.side.fill_len(req)
        tail = self.side.swa_tail_len(fill)
        grow = self._fits(fill, tail, steps)
        if grow is None:
            return None
        from harness.ledger import ADMITTED
        from harness.engines.sim.decode_types import PreallocFailed

        before, free_before = self._pages(), self._free()
        reserved = self.side.reservation(req)
        try:
            result = self.side.prealloc(req)
        except (AssertionError, PreallocFailed) as exc:
            after = self._pages()
            # Admission (_fits, free + evictable) accepted it: a failure here broke admission's promise.
            note = (ADMITTED + " " if isinstance(exc, PreallocFailed) else "") + str(exc)[:200]
            self.ledger.record(
                "alloc_fail",
                rid,
                P,
                fill_len=fill,
                swa_tail_len=tail,
                pages={k: tuple(sorted(before[k] - after[k])) for k in before},
                free_before=free_before,
                free_after=self._free(),
                note=note,
            )
            raise PreallocError(f"decode prealloc of {rid} (fill {fill}, swa tail {tail}) failed: {exc}") from None
        after = self._pages()
        live = _Live(req, group, prompt_len, steps, prefix=result.prefix_len)
        owned = self._owned(live)
        from_cache = {k: (owned[k] - before[k]) | (after[k] - before[k]) for k in before}
        exact = not any(from_cache.values())
        self._record_cache_eviction(from_cache)
        self.ledger.record(
            "prealloc",
            rid,
            P,
            fill_len=result.fill_len,
            swa_tail_len=result.swa_tail_len,
            evicted_seqlen=self._evicted(req),
            prefix_len=result.prefix_len,
            reserved={"full": reserved[0], "swa": reserved[1]},
            pages={k: tuple(sorted(v)) for k, v in owned.items()},
            free_before=free_before if exact else {},
            free_after=self._free(),
            note=f"prefix {result.prefix_len}",
        )
        self.live[rid] = live
        self.reserved[rid] = grow
        # What the real transfer metadata names (DecodePreallocQueue's kv_indices / _swa_payload):
        # full pages past the cached prefix, SWA pages of the window past it, page-floored.
        prefix = result.prefix_len
        live.swa_start = max(prefix, prompt_len - self.spec.window) // P * P
        full, swa = self._locs(live, 0, prompt_len)
        full_pages = {j: int(full[j * P]) // P for j in range(prefix // P, -(-prompt_len // P))}
        swa_pages = {j: int(swa[j * P]) // P for j in range(live.swa_start // P, -(-prompt_len // P))}
        self.dests[rid] = {"full": full_pages, "swa": swa_pages}
        kv_content.dest(self.ledger, rid, P, self.shard, self.dests[rid])
        return {"full": full_pages, "swa": swa_pages, "prefix_len": prefix}

    def write_chunk(self, rid: str, parts: list[tuple[str, list[int]]], data: Any) -> int:
        """Write received pages: ``data`` from the prefill's ``read_chunk`` (or its Ray ObjectRef),
        ``parts`` the ``(pool, decode page ids)`` it carries, in order (:meth:`transfer.Chunk.dst`).

        Returns:
            Bytes written.

        Raises:
            ValueError: ``data`` does not hold the arrays the parts need.
        """
        if not isinstance(data, list):
            import ray

            data = ray.get(data, timeout=60)
        views = [list(getattr(self.buffers, pool)) for pool, _ in parts]
        need = sum(len(v) for v in views)
        if len(data) != need:
            raise ValueError(f"{rid}: chunk has {len(data)} arrays, its parts {parts} need {need}")
        written, at = 0, 0
        for v, (pool, pages) in zip(views, parts):
            written += kvfill.unpack_pages(v, list(pages), data[at : at + len(v)])
            at += len(v)
            # A request released already still lands where it was sent (a late write: write-after-free).
            ords = {p: j for j, p in self.dests.get(rid, self.gone.get(rid, {})).get(pool, {}).items()}
            if all(p in ords for p in pages):
                kv_content.landed(
                    self.ledger, rid, self.spec.page_size, self.shard, pool, list(pages), [ords[p] for p in pages]
                )
        return written

    def commit(self, rid: str, full_pages: list[int], swa_pages: list[int]) -> None:
        """The transfer of ``rid`` is complete: record it and verify every byte of its prompt's KV.

        Full buffers are checked for every prompt token, SWA buffers for the window.

        Raises:
            KVCorruption: a byte differs (request, pool, buffer, position, page named).
            WindowLost: a window token has no SWA slot.
        """
        live = self.live[rid]
        P = self.spec.page_size
        self.ledger.record(
            "transfer", rid, P, pages={"full": tuple(sorted(full_pages)), "swa": tuple(sorted(swa_pages))}
        )
        kv_content.commit(self.ledger, rid, P, self.shard, self.dests.pop(rid, {}), self.buffers)
        self._verify([(live, 0, live.prompt_len)], full=True, when="after transfer")
        self._verify(
            [(live, max(0, live.prompt_len - self.spec.window), live.prompt_len)], full=False, when="after transfer"
        )

    def _verify(self, spans: list[tuple[_Live, int, int]], *, full: bool, when: str) -> None:
        """Check the bytes of positions ``[start, end)`` of every ``(live, start, end)`` in one pass.

        All requests' positions go through one gather and one content computation per buffer
        (the per-step window check of a whole batch is the decode worker's hottest loop).
        """
        P = self.spec.page_size
        pos_parts, seed_parts, loc_parts, owners = [], [], [], []
        for live, start, end in spans:
            if end <= start:
                continue
            full_locs, swa_locs = self._locs(live, start, end)
            if not full and bool((swa_locs == 0).any()):
                pos = start + int((swa_locs == 0).nonzero()[0, 0])
                raise WindowLost(
                    f"request {live.req.rid}: position {pos} inside the window [{start}, {end}) "
                    f"has no SWA slot ({when}); evicted_seqlen={self._evicted(live.req)}"
                )
            pos = torch.arange(start, end, dtype=torch.int64)
            prompt_seed, out_seed = seeds(live.group, live.req.rid, self.shard)
            pos_parts.append(pos)
            seed_parts.append(torch.where(pos < live.prompt_len, prompt_seed, out_seed))
            loc_parts.append(full_locs if full else swa_locs)
            owners.append((len(pos), live.req.rid))
        if not pos_parts:
            return
        locs = torch.cat(loc_parts)
        views = list(self.buffers.full if full else self.buffers.swa)
        b0 = 0 if full else len(self.buffers.full)
        bad = kvfill.verify(views, P, b0, torch.cat(seed_parts), torch.cat(pos_parts), locs // P, locs % P)
        if bad is not None:
            row = bad.index
            for n, rid in owners:
                if row < n:
                    raise KVCorruption(rid, "full" if full else "swa", bad, when)
                row -= n

    def step(self) -> list[str]:
        """One batched decode step for every running request; release the ones that are done.

        Returns:
            The request ids finished (and released) by this step.

        Raises:
            KVCorruption / WindowLost: the window's KV is not intact after the step.
        """
        from harness.engines.sim.pd_decode_side import decode_step

        if not self.live:
            return []
        P = self.spec.page_size
        lives = list(self.live.values())
        rows_before = {lv.req.rid: self._row(lv) for lv in lives}
        owned_before = {lv.req.rid: self._owned(lv, rows_before[lv.req.rid]) for lv in lives}
        ev_before = {lv.req.rid: self._evicted(lv.req) for lv in lives}
        before = self._pages()
        with _eviction_interval(self.spec.eviction_interval):
            out = decode_step(self.side, [lv.req for lv in lives], self.steps)
        self.steps += 1
        after = self._pages()
        taken = {k: before[k] - after[k] for k in before}
        freed = {k: after[k] - before[k] for k in before}
        rows_now = {lv.req.rid: self._row(lv) for lv in lives}
        owned_now = {lv.req.rid: self._owned(lv, rows_now[lv.req.rid]) for lv in lives}
        new_all = {k: set().union(*(owned_now[r][k] - owned_before[r][k] for r in owned_now)) for k in before}
        gone_all = {k: set().union(*(owned_before[r][k] - owned_now[r][k] for r in owned_now)) for k in before}
        # Freed by nobody's row (the radix cache's pages), or handed to a request without passing
        # through the free list (a cache page evicted and reused in the same allocation). A page one
        # request's window eviction gave up and another request took in the same step is neither:
        # the two requests' own events below free and take it.
        self._record_cache_eviction(
            {k: (freed[k] - gone_all[k]) | (new_all[k] - taken[k] - gone_all[k]) for k in before}
        )
        # Every request's eviction first, then every allocation, so a page moving between two
        # requests within the step is freed before it is taken again in the ledger too.
        for lv in lives:
            rid = lv.req.rid
            gone = {k: owned_before[rid][k] - owned_now[rid][k] for k in freed}
            ev = self._evicted(lv.req)
            # The positions whose SWA slot the step really cleared (the ledger's window rule judges
            # them, as it does the real server's probe's), whatever floor sglang recorded.
            was, now = rows_before[rid][1], rows_now[rid][1]
            m = min(len(was), len(now))
            lost = spans((((was[:m] > 0) & (now[:m] == 0)).nonzero().reshape(-1) + lv.prefix).tolist())
            if ev != ev_before[rid] or any(gone.values()) or lost:
                self.ledger.record(
                    "evict",
                    rid,
                    P,
                    evicted_seqlen=ev,
                    freed_spans=lost,
                    fill_len=int(self._kv(lv.req).kv_committed_len),
                    pages={k: tuple(sorted(v)) for k, v in gone.items()},
                )
        new_tokens: dict[str, list[tuple[int, int, int]]] = {"full": [], "swa": []}  # (position, seed, loc)
        for lv, loc in zip(lives, out.tolist()):
            rid = lv.req.rid
            pos = int(self._kv(lv.req).kv_committed_len) - 1
            seed = seeds(lv.group, rid, self.shard)[1]
            _, swa_loc = self._locs(lv, pos, pos + 1)
            new_tokens["full"].append((pos, seed, loc))
            if int(swa_loc[0]):
                new_tokens["swa"].append((pos, seed, int(swa_loc[0])))
            lv.req.output_ids.append(100_001 + pos)  # the "sampled" token
            lv.steps_left -= 1
            new = {k: owned_now[rid][k] - owned_before[rid][k] for k in taken}
            self.ledger.record(
                "decode_alloc",
                rid,
                P,
                fill_len=pos + 1,
                evicted_seqlen=self._evicted(lv.req),
                pages={k: tuple(sorted(v)) for k, v in new.items()},
            )
        for pool, b0 in (("full", 0), ("swa", len(self.buffers.full))):  # the new tokens' KV, one write per pool
            if new_tokens[pool]:
                pos_t, seed_t, loc_t = (torch.tensor(col, dtype=torch.int64) for col in zip(*new_tokens[pool]))
                kvfill.write(list(getattr(self.buffers, pool)), P, b0, seed_t, pos_t, loc_t // P, loc_t % P)
        stray_taken = {k: tuple(sorted(taken[k] - new_all[k])) for k in taken}
        if any(stray_taken.values()):  # taken by the step but in no request's row: a leak
            self.ledger.record("decode_alloc", "<unattributed>", P, pages=stray_taken)
        windows = []
        for lv in lives:
            n = int(self._kv(lv.req).kv_committed_len)
            windows.append((lv, max(0, n - self.spec.window), n))
        self._verify(windows, full=False, when=f"decode step {self.steps}")
        done = [lv.req.rid for lv in lives if lv.steps_left <= 0]
        self._verify(
            [(self.live[rid], 0, int(self._kv(self.live[rid].req).kv_committed_len)) for rid in done],
            full=True,
            when="at finish",
        )
        for rid in done:
            self._release(rid)
        return done

    def _release(self, rid: str, *, abort: bool = False, failed: str | None = None) -> None:
        """Release ``rid``: finished (sglang's release path), ``abort``-ed, or its transfer ``failed``
        (the reason; sglang's failed-transfer path). The ledger's note says which."""
        from harness.engines.sim.pd_decode_side import abort as abort_release
        from harness.engines.sim.pd_decode_side import fail_transfer

        live = self.live.pop(rid)
        self.reserved.pop(rid, None)
        self.gone[rid] = self.dests.pop(rid, {})
        P = self.spec.page_size
        before, free_before = self._pages(), self._free()
        if failed is not None:
            fail_transfer(self.side, live.req, failed)
        elif abort:
            abort_release(self.side, live.req)
        else:
            self.side.release(live.req)
        after = self._pages()
        note = f"failed transfer: {failed}" if failed is not None else "abort" if abort else ""
        self.ledger.record(
            "release",
            rid,
            P,
            pages={k: tuple(sorted(after[k] - before[k])) for k in before},
            free_before=free_before,
            free_after=self._free(),
            note=note,
        )

    def abort(self, rid: str) -> bool:
        """Release a request aborted mid-transfer or mid-decode. Returns False if this rank does not hold it."""
        if rid not in self.live:
            return False
        self._release(rid, abort=True)
        return True

    def retract(self, rid: str) -> bool:
        """Retract a decoding request as sglang does under decode pool pressure (its KV backed up, its
        pages released: ``release_req``); :meth:`resume` brings it back. Returns False if this rank
        does not hold it.

        Raises:
            PreallocError: sglang took no backup (it would abort the request).
        """
        from harness.engines.sim.pd_decode_side import retract

        if rid not in self.live:
            return False
        live = self.live[rid]
        before, free_before = self._pages(), self._free()
        # Still live until sglang released it: a target without retraction (CapabilityMissing) or a
        # failed release leaves the request held, as it is, for the run's own release.
        saved = retract(self.side, live.req, remaining=len(self.live) - 1)
        del self.live[rid]
        self.reserved.pop(rid, None)
        after = self._pages()
        self.ledger.record(
            "release",
            rid,
            self.spec.page_size,
            pages={k: tuple(sorted(after[k] - before[k])) for k in before},
            free_before=free_before,
            free_after=self._free(),
            note="retract",
        )
        if not saved:
            raise PreallocError(f"decode retraction of {rid}: sglang took no KV backup")
        self.retracted[rid] = live
        return True

    def resume(self) -> list[str]:
        """Resume the retracted requests sglang's admission budgets let in (``resume_retracted_reqs``:
        preallocated again, the backup restored), and verify every byte of their restored KV.

        Returns:
            The resumed request ids.

        Raises:
            KVCorruption / WindowLost: a restored byte differs, or a window token has no SWA slot.
        """
        from harness.engines.sim.pd_decode_side import resume

        if not self.retracted:
            return []
        P = self.spec.page_size
        free_before = self._free()
        resumed = resume(self.side, [lv.req for lv in self.live.values()])
        out = []
        for req in resumed:
            live = self.retracted.pop(req.rid)
            live.prefix = 0
            self.live[req.rid] = live
            fill = int(self._kv(req).kv_committed_len)
            owned = self._owned(live)
            tail = self.side.swa_tail_len(fill)
            self.ledger.record(
                "prealloc",
                req.rid,
                P,
                fill_len=fill,
                swa_tail_len=tail,
                evicted_seqlen=self._evicted(req),
                prefix_len=0,
                pages={k: tuple(sorted(v)) for k, v in owned.items()},
                free_before=free_before if len(resumed) == 1 else {},
                free_after=self._free() if len(resumed) == 1 else {},
                note="resume",
            )
            self.reserved[req.rid] = self._growth(fill, tail, live.steps_left)  # as admission reserves it
            self._verify([(live, 0, fill)], full=True, when="after resume")
            self._verify([(live, max(0, fill - self.spec.window), fill)], full=False, when="after resume")
            out.append(req.rid)
        return out

    def fail(self, rid: str, reason: str) -> bool:
        """Fail the transfer of ``rid`` (its pages stopped arriving) through sglang's failed-transfer
        path, which releases what prealloc took. Returns False if this rank does not hold it."""
        if rid not in self.live:
            return False
        self._release(rid, failed=reason)
        return True

    def drain_cache(self) -> None:
        """Evict the decode radix cache (radix mode), recording the pages it gives back."""
        before, free_before = self._pages(), self._free()
        self.side.evict_cache()
        after = self._pages()
        freed = {k: tuple(sorted(after[k] - before[k])) for k in before}
        if any(freed.values()):
            self.ledger.record(
                "evict", "<cache>", self.spec.page_size, pages=freed, free_before=free_before, free_after=self._free()
            )

    def idle(self) -> dict[str, Any]:
        """Live requests and the free sizes versus the baseline the pools started with."""
        return {
            "live": sorted(self.live) + sorted(self.retracted),
            "free": self._free(),
            "baseline": {
                **{k: v for k, v in self.side.baseline.free().items() if k in ("full", "swa", "host")},
                **self.side.baseline.resources(),
            },
        }
