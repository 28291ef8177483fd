"""Capability probes: what a suite needs from the running sglang target, asked of the code itself.

Each :class:`Capability` (:data:`CAPABILITIES`) names one thing a suite needs, says which release or
PR brought it and probes for it (importing sglang); a suite whose capability the target lacks is
skipped (:func:`require`, :func:`require_device` raise :class:`CapabilityMissing`, a pytest skip) with
one line naming the capability and the target. :func:`device_missing` reads the target's source for
what it needs to build pools on this machine's device (imports nothing).
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from harness.targets.sglang import selection
from harness.targets.sglang.releases import source_text
from harness.targets.sglang.version import release_tuple

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Capability:
    """One thing a suite needs from the target.

    Attributes:
        name: what suites ask for.
        description: what it is, and the release/PR that brought it.
        probe: returns None when present, else a short reason (imports sglang).
    """

    name: str
    description: str
    probe: Callable[[], str | None]


def _module(name: str) -> Any:
    import importlib

    return importlib.import_module(name)


def _has(module: str, qualname: str) -> str | None:
    try:
        owner: Any = _module(module)
    except ImportError as exc:
        return f"{module} does not import ({exc})"
    for part in qualname.split("."):
        if not hasattr(owner, part):
            return f"no {module}:{qualname}"
        owner = getattr(owner, part)
    return None


def _first(*reasons: Callable[[], str | None]) -> str | None:
    for reason in reasons:
        found = reason()
        if found:
            return found
    return None


_DECODE = "sglang.srt.disaggregation.decode"

CAPABILITIES: dict[str, Capability] = {
    cap.name: cap
    for cap in (
        Capability(
            "decode-prealloc-swa-tail",
            "PD decode prealloc with an SWA tail: DecodePreallocQueue._pre_alloc / _swa_tail_len / "
            "_uses_swa_tail_prealloc and alloc_for_decode_prealloc (sglang#24036, page floor #35286/#35396)",
            lambda: _first(
                lambda: _has(_DECODE, "DecodePreallocQueue._pre_alloc"),
                lambda: _has(_DECODE, "DecodePreallocQueue._swa_tail_len"),
                lambda: _has(_DECODE, "DecodePreallocQueue._uses_swa_tail_prealloc"),
                lambda: _has(_DECODE, "alloc_for_decode_prealloc"),
                lambda: _has("sglang.srt.mem_cache.allocator.swa", "SWATokenToKVPoolAllocator.alloc_extend_swa_tail"),
            ),
        ),
        Capability(
            "hisparse-prealloc",
            "the DeepSeek-V4 hisparse decode prealloc: alloc_for_decode_prealloc_hisparse, "
            "DeepSeekV4HiSparseTokenToKVPoolAllocator and HiSparseCoordinator",
            lambda: _first(
                lambda: _has(_DECODE, "alloc_for_decode_prealloc_hisparse"),
                lambda: _has("sglang.srt.mem_cache.allocator.hisparse", "DeepSeekV4HiSparseTokenToKVPoolAllocator"),
                lambda: _has("sglang.srt.managers.hisparse_coordinator", "HiSparseCoordinator"),
            ),
        ),
        Capability(
            "hisparse-device",
            "the hisparse graph can be built on this machine's device (see device_missing: up to 0.5.21 the "
            "coordinator needs CUDA streams on the venv's torch even with no GPU)",
            lambda: _hisparse_device(),
        ),
        Capability(
            "decode-admission-budgets",
            "the idle decode scheduler's admission budgets: DecodePreallocQueue._allocatable_token_budgets "
            "and _swa_aware_allocatable_token_budgets",
            lambda: _first(
                lambda: _has(_DECODE, "DecodePreallocQueue._allocatable_token_budgets"),
                lambda: _has(_DECODE, "DecodePreallocQueue._swa_aware_allocatable_token_budgets"),
            ),
        ),
        Capability(
            "decode-reservation",
            "page-rounded decode prealloc reservation: DecodePreallocQueue._prealloc_required_tokens (sglang#35265)",
            lambda: _has(_DECODE, "DecodePreallocQueue._prealloc_required_tokens"),
        ),
        Capability(
            "decode-radix-swa-reclaim",
            "_pre_alloc itself reclaims evictable SWA pages of the decode radix cache before allocating "
            "(sglang#40309, first in 0.5.21; before it only pop_preallocated's caller-side reclaim did)",
            lambda: _pre_alloc_reclaims_swa(),
        ),
        Capability(
            "decode-prealloc-async-h2d",
            "alloc_for_decode_prealloc of 0.5.23: length tensors through async_h2d and the SWA floor recorded "
            "with req.kv.set_evicted_seqlen (a fault rebuilt from that code needs both)",
            lambda: _first(
                lambda: None if "async_h2d" in vars(_module(_DECODE)) else f"no async_h2d in {_DECODE}",
                lambda: _has("sglang.srt.mem_cache.unified_cache.components", "ComponentType"),
            ),
        ),
        Capability(
            "decode-prealloc-evict-floor-assert",
            "alloc_for_decode_prealloc and alloc_for_decode_prealloc_hisparse assert the SWA floor "
            "fill_len - swa_tail_len is >= 0 and page-aligned before recording it (sglang#35286 / #35396, "
            "first in 0.5.19; before it an unaligned floor was recorded as given)",
            lambda: _prealloc_asserts_floor(),
        ),
        Capability(
            "decode-radix-swa-prefix",
            "pop_preallocated keeps a decode radix prefix hit out of the SWA tail: caps it at the window start "
            "and keeps only its full-attention lock (first in 0.5.19; before it _pre_alloc left the SWA-tail "
            "path for a request with a prefix hit)",
            lambda: _pop_preallocated_keeps_prefix_out_of_tail(),
        ),
        Capability(
            "decode-swa-reservation",
            "DecodePreallocQueue._uses_swa_reservation: admission reserves full capacity separately from the "
            "SWA tail (0.5.21)",
            lambda: _has(_DECODE, "DecodePreallocQueue._uses_swa_reservation"),
        ),
        Capability(
            "free-swa-out-of-window-slots",
            "decode-step SWA window eviction through mem_cache.common.free_swa_out_of_window_slots",
            lambda: _has("sglang.srt.mem_cache.common", "free_swa_out_of_window_slots"),
        ),
        Capability(
            "decode-retraction",
            "PD decode retraction with a KV backup and its resumption: schedule_batch.release_req backing the KV "
            "up through mem_cache.common.backup_kv_cache (in 0.5.22 and 0.5.23; missing through 0.5.18, whose "
            "release_req takes server_args and backs up otherwise) and DecodePreallocQueue.resume_retracted_reqs",
            lambda: _first(
                lambda: _has("sglang.srt.managers.schedule_batch", "release_req"),
                lambda: _has(_DECODE, "DecodePreallocQueue.resume_retracted_reqs"),
                lambda: _has("sglang.srt.mem_cache.common", "backup_kv_cache"),
            ),
        ),
        Capability(
            "status-read-through-get",
            "CommonKVManager.update_status reads a room's status once, with request_status.get, before it writes "
            "(0.5.20 on; up to 0.5.19 it reads with `in` and `[]`, so the harness's hold between read and write, "
            "which sits in the status table's get, is never reached, and a Failed write to a missing room is "
            "refused)",
            lambda: _status_read_through_get(),
        ),
        Capability(
            "free-kv-row-segments",
            "release through mem_cache.common.free_kv_row_segments (the SWA-aware row free)",
            lambda: _has("sglang.srt.mem_cache.common", "free_kv_row_segments"),
        ),
    )
}


def reads_status_through_get(update_status_source: str) -> bool:
    """Whether ``CommonKVManager.update_status``'s source reads the room's status with ``request_status.get``."""
    return "request_status.get(" in update_status_source


def _status_read_through_get() -> str | None:
    mgr = getattr(_module("sglang.srt.disaggregation.common.conn"), "CommonKVManager", None)
    update = getattr(mgr, "update_status", None)
    if update is None:
        return "no CommonKVManager.update_status in sglang.srt.disaggregation.common.conn"
    if reads_status_through_get(inspect.getsource(update)):
        return None
    return "update_status reads the room with `in` and `[]`, not request_status.get"


def _hisparse_device() -> str | None:
    device = "cuda:0" if Path("/dev/nvidiactl").exists() else "cpu"
    lacking = device_missing(device, page_size=256, hisparse=True)
    return None if lacking is None else f"{lacking[0]}: {lacking[1]}"


def _pre_alloc_reclaims_swa() -> str | None:
    # Where the reclaim lives is a property of the release (#40309 moved it into _pre_alloc in
    # 0.5.21), decided by the version once: a 0.5.21+ tree whose _pre_alloc lost the call is a
    # regression the suites must see, not a reason for the caller-side shim to reclaim on its behalf.
    release = release_tuple(selection.current().version)
    if release is not None:
        return None if release >= (0, 5, 21) else f"sglang {'.'.join(map(str, release))} predates #40309 (0.5.21)"
    # A tree without a version: judge by the code.
    queue = _module(_DECODE).DecodePreallocQueue
    if "_reclaim_swa_tail_capacity" not in inspect.getsource(queue._pre_alloc):
        return "DecodePreallocQueue._pre_alloc does not call _reclaim_swa_tail_capacity"
    return None


def asserts_floor(prealloc_source: str) -> bool:
    """Whether a decode prealloc function's source asserts the SWA floor is >= 0 and page-aligned
    before recording it (sglang#35286 / #35396, first in 0.5.19)."""
    return re.search(r"assert\s*\(?\s*swa_evicted_seqlen >= 0", prealloc_source) is not None


def keeps_prefix_out_of_tail(pop_preallocated_source: str) -> bool:
    """Whether ``DecodePreallocQueue.pop_preallocated``'s source drops the SWA lock of a radix prefix
    hit by name (``dec_swa_lock_only`` in 0.5.19 … 0.5.21, ``release_swa`` since 0.5.22), as it does
    where it also caps the prefix at the window start (first in 0.5.19)."""
    return "dec_swa_lock_only" in pop_preallocated_source or "release_swa" in pop_preallocated_source


def _prealloc_asserts_floor() -> str | None:
    # A property of the release (#35286 / #35396 came in 0.5.19), decided by the version once: a
    # 0.5.19+ tree whose prealloc lost the asserts (the swa-tail-unaligned fault) is a regression the
    # suites must see, not a reason to skip them.
    release = release_tuple(selection.current().version)
    if release is not None:
        return (
            None if release >= (0, 5, 19) else f"sglang {'.'.join(map(str, release))} predates #35286 / #35396 (0.5.19)"
        )
    # A tree without a version: judge by the code.
    decode = _module(_DECODE)
    for name in ("alloc_for_decode_prealloc", "alloc_for_decode_prealloc_hisparse"):
        function = getattr(decode, name, None)
        if function is None:
            return f"no {_DECODE}:{name}"
        if not asserts_floor(inspect.getsource(function)):
            return f"{name} records the SWA floor without asserting it is page-aligned"
    return None


def _pop_preallocated_keeps_prefix_out_of_tail() -> str | None:
    return _keeps_prefix_out_of_tail(_module(_DECODE).DecodePreallocQueue.pop_preallocated)


@functools.lru_cache(maxsize=8)
def _keeps_prefix_out_of_tail(function: Callable[..., Any]) -> str | None:
    # Per function object: reading its source took 16 ms, asked at every decode side built (explore builds
    # one per schedule).
    if keeps_prefix_out_of_tail(inspect.getsource(function)):
        return None
    return "DecodePreallocQueue.pop_preallocated drops no SWA lock of a radix prefix hit (before 0.5.19)"


@functools.cache
def mooncake_host_tensor_send() -> bool:
    """Whether prefill's Mooncake sender should have the pinned-host-tensor send path
    (``supports_host_tensor_indices``: pinned memory and a ``torch.cuda.Event``, first in 0.5.23)
    that the CPU compat patch ``mooncake-host-tensor-indices`` turns off.

    Releases before 0.5.23 have no such path (the patch has nothing to do); from 0.5.23 on the
    attribute must be there, and a tree without it is a change the patch must follow. A tree
    without a version counts as a current one.
    """
    release = release_tuple(selection.current().version)
    return release is None or release >= (0, 5, 23)


def missing(name: str) -> str | None:
    """Why the running target lacks a capability, or None when it has it.

    Args:
        name: a key of :data:`CAPABILITIES`.

    Returns:
        A short reason, or None.

    Raises:
        KeyError: an unknown capability name.
    """
    return CAPABILITIES[name].probe()


# ------------------------------------------------------------------------------------- device


def _skip_base() -> type[BaseException]:
    try:
        import pytest
    except ImportError:  # the bot side (rerun-test --dry-run) runs on a bare interpreter: no test to skip
        return Exception
    return pytest.skip.Exception


class CapabilityMissing(_skip_base()):  # type: ignore[misc]
    """The target lacks a capability a test needs: under pytest this *is* a skip (pytest's own skip
    exception, so a Hypothesis test or a fixture skips too), with one line naming the capability
    and the target."""

    def __init__(self, name: str, reason: str):
        super().__init__(f"{selection.current().label()} lacks capability {name!r}: {reason}", allow_module_level=True)
        self.capability = name
        self.reason = reason

    def __reduce__(self) -> tuple:
        # Raised in a Ray worker, it must reach the driver intact.
        return (type(self), (self.capability, self.reason))


def device_missing(device: str, *, page_size: int, hisparse: bool, root: Path | None = None) -> tuple[str, str] | None:
    """The first capability the target lacks to build decode/prefill pools on ``device``, read from
    its source (imports nothing, so a PD driver can ask before starting ranks).

    * ``paged-allocator-without-triton`` (page size > 1 on a CPU device): up to 0.5.21
      ``PagedTokenToKVPoolAllocator.alloc_extend`` / ``alloc_decode`` launch only their Triton
      kernels, which need a GPU driver ("0 active drivers"); 0.5.22 added ``use_triton_kernels``
      (``current_platform.capabilities.supports_triton``) and the native torch path. On a machine
      without a GPU driver :func:`process_env` runs those kernels in Triton's interpreter, which
      provides the capability; without it the pools cannot be built on CPU. Remove with 0.5.21.
    * ``device-module-without-accelerator`` (hisparse on a CPU device): up to 0.5.21
      ``get_device_module()`` falls back to ``torch.get_device_module()``, which from torch 2.14 (the
      venv's) is ``torch.cuda`` on a CUDA wheel with no GPU, so ``HiSparseCoordinator`` creates CUDA
      streams; 0.5.22 asks ``torch.accelerator.current_accelerator(check_available=True)``. Those
      releases pin torch 2.13, where this held. Remove with 0.5.21.

    Args:
        device: "cpu" or "cuda:N".
        page_size: tokens per page of the pools.
        hisparse: whether the hisparse coordinator is built.
        root: the target's root (default: the running target's).

    Returns:
        ``(capability, reason)``, or None when the target can build them here.
    """
    if not device.startswith("cpu"):
        return None
    if root is None:
        root = Path(selection.current().root)
    if (
        page_size > 1
        and "use_triton_kernels" not in source_text(root, "mem_cache/allocator/paged.py")
        and os.environ.get("TRITON_INTERPRET") != "1"
    ):
        return (
            "paged-allocator-without-triton",
            "its paged allocator runs only Triton kernels, which need a GPU (a native path came in 0.5.22)",
        )
    if hisparse and "current_accelerator" not in source_text(root, "utils/common.py"):
        return (
            "device-module-without-accelerator",
            "its get_device_module() is torch.cuda on this torch with no GPU, so HiSparseCoordinator "
            "needs CUDA streams (fixed in 0.5.22)",
        )
    return None


def require_device(device: str, *, page_size: int, hisparse: bool = False) -> None:
    """Raise :class:`CapabilityMissing` when the target cannot build the pools on ``device``
    (see :func:`device_missing`).

    Args:
        device: "cpu" or "cuda:N".
        page_size: tokens per page.
        hisparse: whether the hisparse coordinator is built.

    Raises:
        CapabilityMissing: one line naming the capability and the target.
    """
    lacking = device_missing(device, page_size=page_size, hisparse=hisparse)
    if lacking:
        raise CapabilityMissing(*lacking)


def require(name: str) -> None:
    """Raise :class:`CapabilityMissing` when the target lacks capability ``name`` (a key of
    :data:`CAPABILITIES`).

    Raises:
        CapabilityMissing: one line naming the capability and the target.
    """
    reason = missing(name)
    if reason:
        raise CapabilityMissing(name, reason)
