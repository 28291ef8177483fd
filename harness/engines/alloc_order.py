"""Allocation order as a knob, on both engines: ``sglang`` (its own) or ``lifo``, where a freed page goes to the
front of its allocator's free list at once, so a page freed early is the next one handed out.

sglang 0.5.23 hands pages out from the front of ``free_pages``; a PD worker (``need_sort=True``) stages its
frees and merges them, sorted, only when an allocation runs short. Under ``lifo`` the freed ids go first
(where: :mod:`harness.targets.sglang.compat.freelist`). Simulated sides apply it to their allocators
(:func:`apply`), a server to the classes (:func:`install`, via ``server/alloc_patch.py``). Knobs:
``HARNESS_ALLOC_ORDER`` and ``HARNESS_POOL_PAGES`` (:func:`knobs`), or a spec's and a stack's own arguments.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable, Mapping

from harness.targets.sglang.compat import freelist

log = logging.getLogger(__name__)

ORDER_ENV = "HARNESS_ALLOC_ORDER"
POOL_PAGES_ENV = "HARNESS_POOL_PAGES"
SGLANG, LIFO = "sglang", "lifo"
ORDERS = (SGLANG, LIFO)


def checked_order(order: str | None, where: str = ORDER_ENV) -> str:
    """``order`` (None or empty: sglang's own), refused with one line naming ``where`` if unknown.

    >>> checked_order(None), checked_order("LIFO")
    ('sglang', 'lifo')
    """
    value = (order or SGLANG).strip().lower()
    if value not in ORDERS:
        raise ValueError(f"{where}={order!r}: use one of {', '.join(ORDERS)}")
    return value


def checked_pages(pages: str | int | None, where: str = POOL_PAGES_ENV) -> int | None:
    """A pool size in pages (None or empty: the engine's default), refused unless a whole number ≥ 2.

    >>> checked_pages("16"), checked_pages("")
    (16, None)
    """
    if pages is None or pages == "":
        return None
    try:
        n = int(pages)
    except ValueError:
        raise ValueError(f"{where}={pages!r}: a whole number of pages") from None
    if n < 2:
        raise ValueError(f"{where}={pages!r}: at least 2 pages")
    return n


def knobs(environ: Mapping[str, str] | None = None) -> tuple[str, int | None]:
    """``(order, pool_pages)`` as ``HARNESS_ALLOC_ORDER`` and ``HARNESS_POOL_PAGES`` say."""
    env = os.environ if environ is None else environ
    return checked_order(env.get(ORDER_ENV)), checked_pages(env.get(POOL_PAGES_ENV))


def _lifo_release(orig: Callable) -> Callable:
    """The paged allocator's ``_release_page_ids``: freed page ids to the front, never staged."""

    def release(self, *page_ids):
        import torch

        if not page_ids:
            return orig(self, *page_ids)
        self.free_pages = torch.cat((*page_ids, self.free_pages))

    release.__wrapped__ = orig  # type: ignore[attr-defined]
    return release


def _lifo_free(orig: Callable) -> Callable:
    """The token allocator's ``free``: freed ids to the front (inside a free group: as sglang does, and
    the group's end frees through here)."""

    def free(self, free_index):
        import torch

        if free_index.numel() == 0 or self.free_group is not None:
            return orig(self, free_index)
        self.free_pages = torch.cat((free_index, self.free_pages))

    free.__wrapped__ = orig  # type: ignore[attr-defined]
    return free


_LIFO = {freelist.PAGED: _lifo_release, freelist.TOKEN: _lifo_free}


def apply(allocator: Any, order: str) -> tuple[list[str], list[str]]:
    """Put ``allocator``'s free lists (those of the allocators it is made of) in ``order``, on this object
    only: another allocator of the same class keeps sglang's order.

    Returns:
        ``(changed, lacking)``: one line per allocator changed, and one per allocator this sglang has no
        free-list hook for (it keeps sglang's order). Both empty under ``sglang``.
    """
    if checked_order(order) == SGLANG:
        return [], []
    done, lacking = [], []
    for leaf in freelist.leaves(allocator):
        try:
            kind, name = freelist.hook(type(leaf))
        except freelist.Lacking as e:
            log.warning("allocation order %s: this sglang lacks %s; that allocator keeps its own order", order, e)
            lacking.append(str(e))
            continue
        setattr(leaf, name, _LIFO[kind](getattr(type(leaf), name)).__get__(leaf))
        done.append(f"{type(leaf).__name__}.{name}")
    return done, lacking


def install(order: str) -> list[str]:
    """Put every allocator class's free list in ``order`` (a server process: all its allocators).

    Returns:
        ``module:Class.method`` per class changed.

    Raises:
        freelist.Lacking: this sglang has no free-list hook (one line: what is missing).
    """
    if checked_order(order) == SGLANG:
        return []
    done = []
    for kind, cls, name in freelist.classes():
        if getattr(cls.__dict__.get(name), "__wrapped__", None) is not None:
            continue  # installed already (a forked server runs sitecustomize again)
        setattr(cls, name, _LIFO[kind](getattr(cls, name)))
        done.append(f"{cls.__module__}:{cls.__name__}.{name}")
    return done
