"""A real server's allocation order and pool size (:mod:`harness.engines.alloc_order`): the order is
installed on sglang's allocator classes when their package is imported (``sitecustomize``, when
``HARNESS_ALLOC_ORDER`` asks); the pool size in pages becomes ``--max-total-tokens`` (:func:`pool_args`).
"""

from __future__ import annotations

import logging
from typing import Any, Mapping, Sequence

from harness.engines import alloc_order
from harness.engines.server.hooks import after_import
from harness.targets.sglang.compat import freelist

log = logging.getLogger(__name__)


def install_from_env(environ: Mapping[str, str] | None = None) -> str:
    """Install ``HARNESS_ALLOC_ORDER`` once sglang's allocator package is imported.

    Returns:
        The order (``sglang``: nothing installed).

    Raises:
        ValueError: an unknown order (the server refuses to start rather than run in the wrong one).
    """
    order, _ = alloc_order.knobs(environ)
    if order == alloc_order.SGLANG:
        return order

    def on_import(_mod: Any) -> None:
        try:
            done = alloc_order.install(order)
        except freelist.Lacking as e:
            log.warning("allocation order %s: this sglang lacks %s; its own order stays", order, e)
            return
        log.info("allocation order %s: %s", order, ", ".join(done) or "installed already")

    for module in freelist.MODULES:
        after_import(module, on_import)
    return order


def _flag_value(args: Sequence[str], flag: str) -> str | None:
    found = None
    for i, arg in enumerate(args):
        name, eq, value = arg.partition("=")
        if name == flag:
            found = value if eq else (args[i + 1] if i + 1 < len(args) else None)
    return found


def pool_args(pages: int | None, args: Sequence[str], explicit: Sequence[str] = ()) -> tuple[str, ...]:
    """``--max-total-tokens`` for a pool of ``pages`` pages of the page size ``args`` give (sglang's
    default 1), in place of a default one; none when ``pages`` is None or ``explicit`` (a role's or a
    test's own flags) sets it.

    >>> pool_args(12, ("--page-size", "64", "--max-total-tokens", "8192")), pool_args(None, ())
    (('--max-total-tokens', '768'), ())
    >>> pool_args(12, ("--max-total-tokens", "99"), explicit=("--max-total-tokens", "99"))
    ()
    """
    if pages is None or _flag_value(explicit, "--max-total-tokens") is not None:
        return ()
    return ("--max-total-tokens", str(pages * int(_flag_value(args, "--page-size") or 1)))
