"""Accounting ledger: typed KV-page events from prefill and decode workers, and a pure checker.

Every worker appends one JSON line per event to ``<run_dir>/ledger/<worker>.jsonl`` (:class:`LedgerWriter`),
first a ``config`` event from which the checker derives every bound; it never takes a bound from sglang's
own numbers. Every name of the modules is re-exported here (``ledger.check(events)``). The config event and
the modules: docs/modules.md.
"""

from harness.ledger.causes import Cause, LedgerBroken, assert_clean, root_causes
from harness.ledger.check import check
from harness.ledger.content import CONTENT_RULES, check_content
from harness.ledger.events import (
    ADMITTED,
    CACHE_OWNER,
    COMPONENTS,
    CONFIG_RID,
    CONTENT_KINDS,
    FREE_KINDS,
    FULL_POOL,
    HOST_POOL,
    IN_FLIGHT,
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
    split_in_flight,
)
from harness.ledger.io import LedgerWriter, read, read_dir
from harness.ledger.rules import KNOCK_ONS, RULES, prealloc_violations, swa_page_bound
from harness.ledger.summary import format_summary, summarise

__all__ = [
    "ADMITTED",
    "CACHE_OWNER",
    "COMPONENTS",
    "CONFIG_RID",
    "CONTENT_KINDS",
    "CONTENT_RULES",
    "FREE_KINDS",
    "FULL_POOL",
    "HOST_POOL",
    "IN_FLIGHT",
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
    "split_in_flight",
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
    "check_content",
    "prealloc_violations",
    "swa_page_bound",
    "format_summary",
    "summarise",
]
