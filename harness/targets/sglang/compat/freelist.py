"""Where a freed page joins an allocator's free list (the capability the allocation-order knob,
:mod:`harness.engines.alloc_order`, changes): the paged allocator's ``_release_page_ids`` and the token
allocator's ``free``, both under ``sglang.srt.mem_cache.allocator``. Read against the source of 0.5.22 and
0.5.23, where both are; a release without them raises :class:`Lacking` with one line, never a failure.
"""

from __future__ import annotations

import importlib
from typing import Any

PAGED, TOKEN = "paged", "token"
#: The module whose import makes both allocator classes exist (the package imports both).
MODULES = ("sglang.srt.mem_cache.allocator",)
#: Attributes of a composite allocator holding the allocators it hands pages out of.
_CHILDREN = ("logical_attn_allocator", "full_attn_allocator", "swa_attn_allocator", "hisparse_attn_allocator")


class Lacking(Exception):
    """This sglang has no free-list hook where the knob looks (one line: what is missing)."""


def _allocator_classes() -> tuple[Any, Any]:
    mod = importlib.import_module(MODULES[0])
    paged, token = getattr(mod, "PagedTokenToKVPoolAllocator", None), getattr(mod, "TokenToKVPoolAllocator", None)
    if paged is None or token is None:
        raise Lacking(f"{MODULES[0]} has no PagedTokenToKVPoolAllocator / TokenToKVPoolAllocator")
    return paged, token


def hook(cls: type) -> tuple[str, str]:
    """``(kind, method)``: where a freed page of an allocator of class ``cls`` joins its free list.

    Raises:
        Lacking: ``cls`` is neither kind, or lacks the method.
    """
    paged, token = _allocator_classes()
    if issubclass(cls, paged):
        if not hasattr(cls, "_release_page_ids"):
            raise Lacking(f"{cls.__name__}._release_page_ids (the paged free list's one way in)")
        return PAGED, "_release_page_ids"
    if issubclass(cls, token):
        return TOKEN, "free"
    raise Lacking(f"a free-list hook for {cls.__module__}.{cls.__name__}")


def classes() -> list[tuple[str, type, str]]:
    """``(kind, class, method)`` of both allocator classes (every PD pool's leaves are one of them)."""
    return [(kind, cls, method) for cls in _allocator_classes() for kind, method in [hook(cls)]]


def leaves(allocator: Any) -> list[Any]:
    """The allocators that really hold free lists under ``allocator`` (an SWA or hisparse composite's
    parts; the allocator itself when it has a ``free_pages`` list)."""
    children = [getattr(allocator, name) for name in _CHILDREN if getattr(allocator, name, None) is not None]
    if not children:
        return [allocator] if getattr(allocator, "free_pages", None) is not None else []
    out: list[Any] = []
    for child in children:
        out += [leaf for leaf in leaves(child) if all(leaf is not seen for seen in out)]
    return out
