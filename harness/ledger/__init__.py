"""Accounting ledger: typed KV-page events from prefill and decode workers, and a pure checker.

Every worker appends one JSON line per event to ``<run_dir>/ledger/<worker>.jsonl`` through a
:class:`LedgerWriter` (one writer per file, flushed per line, so a killed worker leaves every event
it wrote readable). :func:`read` and :func:`read_dir` load them back as :class:`Event` objects.

A worker first writes a ``config`` event (:func:`config_event`): the configuration it runs with —
page size P, sliding window W, radix cache on/off, whether decode preallocates only the SWA tail,
the SWA eviction interval, the decode reserve, the hisparse host page and compression ratio — and
its pools' free sizes at start (the baseline). The checker derives every bound from that
configuration (:class:`LedgerConfig`); it never takes a bound from sglang's own numbers.

Modules: :mod:`.events` (the event types, the configuration, :class:`Violation`), :mod:`.io`
(:class:`LedgerWriter`, :func:`read`, :func:`read_dir`), :mod:`.rules` (every rule the checker enforces, :data:`RULES`,
and those of one event), :mod:`.check` (the pure checker :func:`check`), :mod:`.causes` (root causes first), :mod:`.summary` (per-request totals). Every name is
re-exported here (``ledger.check(events)``).
"""

from harness.ledger.causes import Cause, LedgerBroken, assert_clean, root_causes
from harness.ledger.check import check
from harness.ledger.events import (
    ADMITTED,
    CACHE_OWNER,
    COMPONENTS,
    CONFIG_RID,
    FREE_KINDS,
    FULL_POOL,
    HOST_POOL,
    KINDS,
    SWA_POOL,
    TAKE_KINDS,
    UNREADABLE,
    Event,
    LedgerConfig,
    Pages,
    Spans,
    Violation,
    config_event,
    spans,
)
from harness.ledger.io import LedgerWriter, read, read_dir
from harness.ledger.rules import KNOCK_ONS, RULES, prealloc_violations, swa_page_bound
from harness.ledger.summary import format_summary, summarise

__all__ = [
    "ADMITTED",
    "CACHE_OWNER",
    "COMPONENTS",
    "CONFIG_RID",
    "FREE_KINDS",
    "FULL_POOL",
    "HOST_POOL",
    "KINDS",
    "SWA_POOL",
    "TAKE_KINDS",
    "UNREADABLE",
    "Event",
    "LedgerConfig",
    "Pages",
    "Spans",
    "Violation",
    "config_event",
    "spans",
    "LedgerWriter",
    "read",
    "read_dir",
    "KNOCK_ONS",
    "RULES",
    "Cause",
    "LedgerBroken",
    "assert_clean",
    "root_causes",
    "check",
    "prealloc_violations",
    "swa_page_bound",
    "format_summary",
    "summarise",
]
