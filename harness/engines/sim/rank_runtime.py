"""Process-level environment the decode-side objects need: the published runtime context, a
world-size-1 process group and host-pool allocation without CUDA pinning.

These are *environment*, not code under test: sglang's scheduler normally provides them (:func:`publish`,
:func:`unpinned_host_pools`, :func:`host_pool_budget`). Why each is needed: docs/modules.md.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from dataclasses import dataclass
from typing import Any, Iterator

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RuntimeSettings:
    """The server settings a worker publishes that change decode prealloc and release behaviour.

    Attributes:
        device: the device its pools are on.
        radix_cache: ``--disaggregation-decode-enable-radix-cache``.
        page_size: ``--page-size`` (None: sglang's default); 0.5.16's ``release_kv_cache`` reads it from
            the server arguments (later releases from the allocator).
        retraction_backup: ``--disaggregation-decode-retraction-backup`` (None: not published; a
            retraction and its resumption publish ``cpu_tensor``, as the CPU servers run).
    """

    device: str = "cpu"
    radix_cache: bool = False
    page_size: int | None = None
    retraction_backup: str | None = None


_published: dict[str, Any] = {"settings": None, "override": None}
#: settings -> the context state its override installed (:func:`_context_state`), so a rank that publishes
#: settings seen before sets that state again instead of building sglang's ``ServerArgs`` and config bags anew
#: (18 ms each; in one process the explorer's prefill and decode sides switch settings every schedule).
_installed: dict[RuntimeSettings, tuple] = {}
_INSTALLED_MAX = 64


#: What sglang's own ``_ServerArgsOverride`` saves and restores of the context (0.5.21 on), as dotted paths.
_CONTEXT_FIELDS = (
    "_server_args",
    "_config_bags",
    "_overrides_log",
    "_publish_role",
    "parallel._config",
    "flags.capture.enable_torch_compile",
)


def _context_state(ctx: Any) -> tuple | None:
    """The values of :data:`_CONTEXT_FIELDS`, or None on a release whose context lacks them."""
    try:
        return tuple(functools.reduce(getattr, path.split("."), ctx) for path in _CONTEXT_FIELDS)
    except AttributeError:
        return None


def _set_context_state(ctx: Any, state: tuple) -> None:
    for path, value in zip(_CONTEXT_FIELDS, state):
        *owner, name = path.split(".")
        setattr(functools.reduce(getattr, owner, ctx), name, value)


def publish(settings: RuntimeSettings) -> None:
    """Publish sglang's runtime context for a PD decode worker, unless already published.

    Args:
        settings: device, whether the decode radix cache is on
            (``--disaggregation-decode-enable-radix-cache``) and the page size.
    """
    if _published["settings"] == settings:
        return
    from sglang.srt.runtime_context import get_context

    ctx = get_context()
    state = _installed.get(settings)
    if state is not None:
        _set_context_state(ctx, state)
        _published["settings"] = settings
        logger.debug("published sglang runtime context %s (as installed before)", settings)
        return
    previous = _published["override"]
    if previous is not None:
        previous.restore()
    device_type = settings.device.split(":", 1)[0]
    fields: dict[str, Any] = dict(
        device=device_type, disaggregation_mode="decode", disaggregation_decode_enable_radix_cache=settings.radix_cache
    )
    if settings.page_size is not None:
        fields["page_size"] = settings.page_size
    if settings.retraction_backup is not None:
        fields["disaggregation_decode_retraction_backup"] = settings.retraction_backup
    override = get_context().override_server_args(**fields)
    override.install()
    _published.update(settings=settings, override=override)
    state = _context_state(ctx)
    if state is not None and len(_installed) < _INSTALLED_MAX:
        _installed[settings] = state
    logger.debug("published sglang runtime context %s", settings)


def published() -> RuntimeSettings | None:
    """The settings currently published by :func:`publish`, or None."""
    return _published["settings"]


def ensure_process_group() -> None:
    """Initialise a world-size-1 gloo process group if none exists (HiSparseCoordinator needs one).

    The rendezvous port is leased from :mod:`harness.workers.ports` (outside the range any outgoing
    connection may take), never from arithmetic.
    """
    import torch.distributed as dist

    from harness.workers.ports import allocate_ports

    if dist.is_initialized():
        return
    port = allocate_ports(("gloo",))["gloo"]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    logger.debug("initialised gloo process group (world size 1) on port %d, pid %d", port, os.getpid())


@contextlib.contextmanager
def unpinned_host_pools(device: str) -> Iterator[None]:
    """While active, sglang host pools on a CPU device are allocated without CUDA pinning.

    sglang picks the host allocation function by device type from ``ALLOC_MEMORY_FUNCS``; the
    default registers the buffer with ``cudaHostRegister``, which needs a CUDA driver. On a CUDA
    device nothing changes.

    Args:
        device: the device the pools are built for ("cpu" or "cuda:N").
    """
    import torch

    if device.startswith("cuda") and torch.cuda.is_available():
        yield
        return
    from sglang.srt.mem_cache.pool_host import common

    table = common.ALLOC_MEMORY_FUNCS
    had_entry = "cpu" in table
    saved = table["cpu"]  # defaultdict: reading inserts the default when absent

    def unpinned(*args: Any, **kwargs: Any) -> Any:
        return saved(*args, **{**kwargs, "pin_memory": False})

    table["cpu"] = unpinned
    try:
        yield
    finally:
        if had_entry:
            table["cpu"] = saved
        else:
            del table["cpu"]


@contextlib.contextmanager
def host_pool_budget() -> Iterator[None]:
    """While active, sglang host pools are booked against the memory available now (no server
    reserve), through sglang's ``host_memory_budget_scope``."""
    import psutil
    from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope

    with host_memory_budget_scope(int(psutil.virtual_memory().available)):
        yield
