"""The decode side of a PD pair, on sglang's real objects: prealloc, release and pool snapshots.

:class:`DecodeSide` holds one decode worker's memory graph and a ``DecodePreallocQueue`` whose methods are
sglang's own; only the environment (the queue shell, the scheduler's fields) is hand-made. Its configuration,
results and error are :mod:`harness.engines.sim.decode_types`. Each operation's real path: docs/modules.md.

Example (run by ``tests/test_examples.py``)::

    from harness.engines.sim import DecodeConfig, DecodeSide, make_req

    side = DecodeSide(DecodeConfig(page_size=64, window=100))
    req = make_req("r0", prompt_len=300)
    result = side.prealloc(req)
    assert result.swa_tail_len == 108  # the window start floored to a page: 300 - 192
    side.release(req)
    assert side.snapshot().free() == side.baseline.free()
"""

from __future__ import annotations

import logging
import types
from typing import Any

from harness.targets.sglang import compat
from harness.targets.sglang.compat import pdstate
from harness.engines import alloc_order
from harness.engines.sim import rank_runtime
from harness.engines.sim import pools as pool_builders
from harness.engines.sim.decode_types import DecodeConfig, PreallocFailed, PreallocResult
from harness.engines.sim.requests import mark_finished
from harness.engines.sim.snapshot import PoolSnapshot, req_state

logger = logging.getLogger(__name__)

# sglang's messages when _pre_alloc finds no request slot, the allocator returns None, or (hisparse,
# allocated right after the KV and before the KV is checked) the host pool has no room.
_ALLOC_FAILURES = ("req_pool_indices is full", "KV cache is full", "host mem pool alloc failed")


class DecodeSide:
    """One decode worker's real memory graph and prealloc queue.

    Args:
        config: what to build.

    Attributes:
        config: the configuration.
        allocator: the token allocator ``_pre_alloc`` uses (the hisparse wrapper on that path).
        kv_pool: the KV pool.
        req_to_token_pool: request slots.
        tree_cache: the ``UnifiedRadixCache``.
        coordinator: the ``HiSparseCoordinator`` (None off the hisparse path).
        queue: the ``DecodePreallocQueue`` shell.
        baseline: the snapshot taken right after building.
    """

    def __init__(self, config: DecodeConfig):
        self.config = config
        self._settings = rank_runtime.RuntimeSettings(
            device=config.device, radix_cache=config.radix_cache, page_size=config.page_size
        )
        rank_runtime.publish(self._settings)
        self.req_to_token_pool = pool_builders.build_req_to_token_pool(config.sizes, config.device)
        self.coordinator = None
        self._build_pools()
        self.tree_cache = pool_builders.build_tree_cache(
            self.req_to_token_pool, self.allocator, config.page_size, config.window, radix_cache=config.radix_cache
        )
        self.queue = self._build_queue()
        alloc_order.apply(self.allocator, config.alloc_order)
        self.baseline = self.snapshot()

    def _build_pools(self) -> None:
        """Build the KV pool and its allocators (and the hisparse coordinator on that path)."""
        config = self.config
        sizes, device = config.sizes, config.device
        if config.hisparse:
            built = pool_builders.build_hisparse_pools(config.page_size, config.window or 0, sizes, device)
            self.kv_pool, self.allocator = built.kv_pool, built.allocator
            self._full_allocator = built.logical_allocator
            self.coordinator = pool_builders.build_hisparse_coordinator(
                self.req_to_token_pool,
                self.allocator,
                device,
                top_k=config.hisparse_top_k,
                device_buffer_size=config.hisparse_device_buffer_size,
            )
        else:
            swa = pool_builders.build_swa_pools(config.page_size, sizes, device)
            self.kv_pool, self.allocator = swa.kv_pool, swa.allocator
            self._full_allocator = swa.allocator

    def _build_queue(self) -> Any:
        from sglang.srt.disaggregation.decode import DecodePreallocQueue

        # Environment only: the fields _pre_alloc, _swa_tail_len, the radix-cache prefix match and
        # the admission budgets read, as an idle scheduler has them (nothing running, waiting or
        # just prebuilt). tp_worker.is_hybrid_swa selects the SWA-aware size accessors.
        scheduler = types.SimpleNamespace(
            sliding_window_size=self.config.window,
            enable_hisparse=self.config.hisparse,
            hisparse_coordinator=self.coordinator,
            enable_decode_hicache=False,
            tp_worker=types.SimpleNamespace(is_hybrid_swa=True),
            running_batch=types.SimpleNamespace(reqs=[]),
            enable_overlap=False,
            waiting_queue=[],
            last_batch=None,
            **compat.scheduler_fields(self.config.radix_cache),
        )
        queue = DecodePreallocQueue.__new__(DecodePreallocQueue)
        queue.req_to_token_pool = self.req_to_token_pool
        queue.token_to_kv_pool_allocator = self.allocator
        queue.token_to_kv_pool = self.allocator.get_kvcache()
        queue.tree_cache = self.tree_cache
        queue.scheduler = scheduler
        queue.num_reserved_decode_tokens = self.config.num_reserved_decode_tokens
        # The scheduler's token capacity (a retracted request re-queued is checked against it).
        queue.max_total_num_tokens = int(getattr(self.allocator, "size_full", self.allocator.size))
        queue.queue, queue.retracted_queue, queue.pending_reqs = [], [], []
        queue.transfer_queue = types.SimpleNamespace(queue=[])
        return queue

    def ledger_config(self, eviction_interval: int = 1) -> Any:
        """The :class:`harness.ledger.LedgerConfig` this side runs with, from its configuration.

        Every value comes from :class:`DecodeConfig` (or, for the hisparse host page and the
        compression ratio, the model constants the pools were built with), never from what sglang
        computes per request, so the ledger's bounds stay independent of the code under test.

        Args:
            eviction_interval: ``SGLANG_SWA_EVICTION_INTERVAL`` of the process running decode steps.

        Returns:
            The configuration for a ledger ``config`` event.
        """
        from harness.ledger import LedgerConfig

        config = self.config
        reserve = config.num_reserved_decode_tokens
        host_page = compression = None
        if self.coordinator is not None:
            host_page = int(self.allocator.hisparse_page_size)
            compression = int(self.coordinator.compress_ratio) if self.coordinator.is_dsv4_hisparse else 1
        return LedgerConfig(
            page_size=config.page_size,
            window=config.window or None,
            radix_cache=config.radix_cache,
            # hybrid-SWA and DeepSeek-V4 pools preallocate the window tail when pages are > 1
            swa_tail=bool(config.window) and config.page_size > 1,
            eviction_interval=max(1, eviction_interval),
            decode_reserve=reserve,
            # sglang drops the SWA reserve only with --disable-radix-cache (never set here)
            swa_decode_reserve=reserve,
            host_page=host_page,
            compression=compression,
            # before 0.5.19 a radix prefix hit keeps its SWA in the tree, the floor at its end
            prefix_swa_in_tree=config.radix_cache and compat.prefix_swa_in_tree(),
        )

    # -- sglang's own computations, exposed for tests -------------------------------------------

    def fill_len(self, req: Any) -> int:
        """``DecodePreallocQueue._pre_alloc_fill_len(req)``: tokens prealloc gives the request."""
        return self.queue._pre_alloc_fill_len(req)

    def swa_tail_len(self, fill_len: int) -> int:
        """``DecodePreallocQueue._swa_tail_len(fill_len)``: tokens of the fill that get SWA slots."""
        rank_runtime.publish(self._settings)
        return self.queue._swa_tail_len(fill_len)

    def reservation(self, req: Any) -> tuple[int, int]:
        """``DecodePreallocQueue._prealloc_required_tokens(req)``: the (full, SWA) tokens admission reserves."""
        rank_runtime.publish(self._settings)
        full, swa = self.queue._prealloc_required_tokens(req)
        return int(full), int(swa)

    def uses_swa_tail(self) -> bool:
        """``DecodePreallocQueue._uses_swa_tail_prealloc()``."""
        return self.queue._uses_swa_tail_prealloc()

    def admission_budget(self) -> tuple[int, int | None]:
        """The token budgets an idle decode scheduler admits preallocations against.

        ``DecodePreallocQueue._swa_aware_allocatable_token_budgets()`` on the SWA-tail path,
        ``_allocatable_token_budgets()`` otherwise.

        Returns:
            ``(full_budget, swa_budget)``; ``swa_budget`` is None off the SWA-tail path.
        """
        rank_runtime.publish(self._settings)
        if self.queue._uses_swa_tail_prealloc():
            full, swa = self.queue._swa_aware_allocatable_token_budgets()
            return int(full), int(swa)
        return int(self.queue._allocatable_token_budgets()), None

    # -- operations -------------------------------------------------------------------------------

    def alloc_with_tail(self, req: Any, swa_tail_len: int) -> Any:
        """Allocate a request with a caller-chosen SWA tail, bypassing ``_swa_tail_len``.

        Takes the request slot (as ``_pre_alloc`` does) and calls sglang's own
        ``alloc_for_decode_prealloc`` (or ``alloc_for_decode_prealloc_hisparse``) with
        ``fill_len = _pre_alloc_fill_len(req)``. This is how a test feeds the real allocation path
        an unaligned tail without replacing any sglang code.

        Args:
            req: a request holding no KV.
            swa_tail_len: the tail to allocate SWA slots for.

        Returns:
            The full-pool indices sglang allocated.

        Raises:
            PreallocFailed: no free request slot.
            AssertionError: sglang's own checks (page alignment of ``fill_len - swa_tail_len``).
        """
        from sglang.srt.disaggregation import decode

        rank_runtime.publish(self._settings)
        fill_len = self.queue._pre_alloc_fill_len(req)
        if self.req_to_token_pool.alloc([req]) is None:
            raise PreallocFailed(req.rid, "no free request slot", {})
        if self.config.hisparse:
            return decode.alloc_for_decode_prealloc_hisparse(
                self.allocator, req=req, fill_len=fill_len, uses_swa_tail=True, swa_tail_len=swa_tail_len
            )
        return decode.alloc_for_decode_prealloc(
            self.allocator,
            **compat.decode_prealloc_kwargs(
                decode.alloc_for_decode_prealloc,
                dict(
                    req=req,
                    fill_len=fill_len,
                    delta_len=fill_len,
                    prefix_len=0,
                    total_prefix_len=0,
                    prefix_indices=None,
                    uses_swa_tail=self.queue._uses_swa_tail_prealloc(),
                    swa_tail_len=swa_tail_len,
                    req_to_token_pool=self.req_to_token_pool,
                ),
            ),
        )

    def prealloc(self, req: Any) -> PreallocResult:
        """Preallocate a received request through the real ``DecodePreallocQueue._pre_alloc``.

        With the decode radix cache on, first matches and locks the reusable full-attention prefix
        (``_match_prefix_and_lock``), caps it at the SWA window start and releases its SWA lock, as the
        target release's ``pop_preallocated`` does (:func:`~harness.targets.sglang.compat.decode_prefix_match`).

        Args:
            req: a ``Req`` from :func:`make_req` holding no KV yet.

        Returns:
            The :class:`PreallocResult`.

        Raises:
            PreallocFailed: the allocator could not hold the request.
            AssertionError: any other sglang assertion, e.g. the page-alignment check on
                ``fill_len - swa_tail_len``; state is left exactly as sglang left it.
        """
        rank_runtime.publish(self._settings)
        queue = self.queue
        prefix_indices, prefix_len, total_prefix_len = None, 0, 0
        if self.config.radix_cache:
            prefix_indices, prefix_len, total_prefix_len = compat.decode_prefix_match(queue, req)
        fill_len = queue._pre_alloc_fill_len(req)
        uses_swa_tail = queue._uses_swa_tail_prealloc()
        swa_tail_len = queue._swa_tail_len(fill_len)
        shortfall = compat.caller_swa_reclaim(queue, req)  # the release's own caller-side step, if it had one
        if shortfall:
            logger.debug("%s", shortfall)
        before = self.snapshot()
        try:
            destination = queue._pre_alloc(req, prefix_indices, prefix_len, total_prefix_len)
        except (AssertionError, RuntimeError) as exc:
            if not any(message in str(exc) for message in _ALLOC_FAILURES):
                raise
            held = self.snapshot().taken_since(before)
            self._abort_failed_prealloc(req)
            raise PreallocFailed(req.rid, str(exc), held) from exc
        compat.req_kv(req).cache_protected_len = total_prefix_len
        if prefix_len > 0 and compat.missing("decode-radix-swa-prefix"):
            # Before 0.5.19 _pre_alloc leaves the SWA-tail path for a prefix hit
            # (``uses_swa_tail and prefix_len == 0``): SWA for the whole extension past the prefix.
            uses_swa_tail, swa_tail_len = False, fill_len
        logger.debug("prealloc %s fill=%d tail=%d prefix=%d", req.rid, fill_len, swa_tail_len, prefix_len)
        return PreallocResult(
            rid=req.rid,
            fill_len=fill_len,
            swa_tail_len=swa_tail_len,
            uses_swa_tail=uses_swa_tail,
            prefix_len=prefix_len,
            destination=destination,
        )

    def _abort_failed_prealloc(self, req: Any) -> None:
        # Abort a request that got a slot (and, hisparse, host slots) but no KV, through sglang's
        # own paths: the coordinator frees the slot's host rows, the pool frees the row, the tree
        # drops the prefix lock. Full and SWA pages are deliberately not touched.
        kv = compat.req_kv(req)
        if kv.holds_kv:
            if self.coordinator is not None:
                self.coordinator.request_finished(req)
            self.req_to_token_pool.free(req)
        kv.mark_kv_released()
        if getattr(req, "lock", None) is not None:
            self.tree_cache.unlock(req.lock)
            req.lock = None

    def release(self, req: Any) -> None:
        """Release a finished request through the real path: ``HiSparseCoordinator.request_finished``
        (hisparse) then ``release_kv_cache(req, tree_cache, checkpoint=True)``.

        Args:
            req: a request that :meth:`prealloc` succeeded for; marked finished if not already.
        """

        rank_runtime.publish(self._settings)
        if not req.finished():
            mark_finished(req)
        if self.coordinator is not None:
            self.coordinator.request_finished(req)
        compat.release_kv_cache(req, self.tree_cache, checkpoint=True)

    def evict_cache(self) -> int:
        """Evict everything evictable from the decode radix cache (``tree_cache.evict``).

        Returns:
            Full-pool tokens evicted (0 with the cache off).
        """
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        if not self.config.radix_cache:
            return 0
        rank_runtime.publish(self._settings)
        total = self.allocator.size_full + self.allocator.size_swa
        return self.tree_cache.evict(EvictParams(num_tokens=total, swa_num_tokens=total)).num_tokens_evicted

    def snapshot(self, reqs: tuple[Any, ...] | list[Any] = ()) -> PoolSnapshot:
        """Read every pool's free size and the KV state of ``reqs`` (changes nothing).

        Args:
            reqs: requests whose state to include.

        Returns:
            The :class:`PoolSnapshot`.
        """
        hisparse_free = host_free = None
        if self.coordinator is not None:
            hisparse_free = int(self.allocator.hisparse_attn_allocator.available_size())
            host_free = int(self.coordinator.mem_pool_host.available_size())
        tree = self.tree_cache
        radix = self.config.radix_cache
        return PoolSnapshot(
            full=int(self._full_allocator.full_available_size()),
            swa=int(self.allocator.swa_available_size()),
            req_slots=int(self.req_to_token_pool.available_size()),
            hisparse_device=hisparse_free,
            host=host_free,
            tree_full_evictable=int(tree.full_evictable_size()) if radix else 0,
            tree_swa_evictable=int(tree.swa_evictable_size()) if radix else 0,
            tree_locked=pdstate.tree_locked(tree)[0],
            requests=tuple(req_state(r, self.req_to_token_pool, self.allocator, self.coordinator) for r in reqs),
        )
