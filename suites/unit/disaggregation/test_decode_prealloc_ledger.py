"""PD decode prealloc and release, written to the accounting ledger and checked by it.

Each request's pages are read from sglang's own state after the real ``_pre_alloc`` and before the
real ``release_kv_cache`` (its ``req_to_token`` row and the allocator's full->SWA mapping), with the
pools' free sizes around each step, and appended to a ledger file through
:class:`harness.ledger.LedgerWriter`. The pure checker :func:`harness.ledger.check` then has to
find the books balanced against the configuration the ledger starts with (its ``config`` event):
the SWA tail keeps the window and at most a page more, the eviction floor is page-aligned and equals
``fill - tail``, each pool is charged the whole pages the configuration implies, the admission
reservation covers them, every pool moved by exactly the pages an event names, and every page taken
is returned.

This is the independent line of defence behind sglang's own assertions: if one of them is ever
lost (``swa-tail-unaligned`` in the fault catalog removes the floor and the asserts), the ledger
still sees the unaligned floor. Events are checked as they are written (rules about single events), and the whole ledger
once every request is released.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from harness.api import DecodeSide, PreallocResult, ledger, make_req

# (page size, window, prompt lengths of requests live together). The lengths put the window start
# off a page boundary, so a tail without sglang's floor to a page shows.
CASES = [
    pytest.param(64, 100, (300, 1000, 129), id="page64-w100"),
    pytest.param(16, 100, (250, 77), id="page16-w100"),
    pytest.param(256, 128, (385, 700), id="page256-w128"),
]

WORKER = "decode-0"


def _page_ids(slots: tuple[int, ...], page_size: int) -> tuple[int, ...]:
    # Slot 0 is the pools' padding slot: in the full->SWA mapping it means "no SWA slot".
    return tuple(sorted({slot // page_size for slot in slots if slot > 0}))


def _held_pages(side: DecodeSide, req: Any) -> dict[str, tuple[int, ...]]:
    state = side.snapshot([req]).request(req.rid)
    page = side.config.page_size
    return {"full": _page_ids(state.full_indices, page), "swa": _page_ids(state.swa_indices, page)}


def _pool_free(side: DecodeSide) -> dict[str, int]:
    free = side.snapshot().free()
    return {"full": free["full"], "swa": free["swa"]}


def _event_violations(writer: ledger.LedgerWriter) -> list[ledger.Violation]:
    # Rules about single events (a violation with a seq); page-leak needs the finished ledger.
    return [v for v in ledger.check(writer.events) if v.seq is not None]


def _prealloc(side: DecodeSide, writer: ledger.LedgerWriter, req: Any) -> PreallocResult:
    before = _pool_free(side)
    full_reserved, swa_reserved = side.reservation(req)  # what admission would reserve for it
    result = side.prealloc(req)
    state = side.snapshot([req]).request(req.rid)
    writer.record(
        "prealloc",
        req.rid,
        side.config.page_size,
        fill_len=result.fill_len,
        swa_tail_len=result.swa_tail_len,
        evicted_seqlen=state.swa_evicted_seqlen,
        prefix_len=result.prefix_len,
        pages=_held_pages(side, req),
        reserved={"full": full_reserved, "swa": swa_reserved},
        free_before=before,
        free_after=_pool_free(side),
    )
    return result


def _release(side: DecodeSide, writer: ledger.LedgerWriter, req: Any) -> None:
    held = _held_pages(side, req)
    before = _pool_free(side)
    side.release(req)
    writer.record(
        "release", req.rid, side.config.page_size, pages=held, free_before=before, free_after=_pool_free(side)
    )


@pytest.mark.parametrize("page, window, prompt_lens", CASES)
def test_decode_prealloc_ledger_balances(
    decode_side, tmp_path: Path, page: int, window: int, prompt_lens: tuple[int, ...]
):
    side = decode_side(page_size=page, window=window)
    assert side.uses_swa_tail()
    path = tmp_path / "ledger" / f"{WORKER}.jsonl"
    reqs = [make_req(f"r{i}-{n}", prompt_len=n) for i, n in enumerate(prompt_lens)]

    with ledger.LedgerWriter(path, WORKER, "decode") as writer:
        # The bounds the checker applies come from this configuration, not from sglang's answers.
        writer.record("config", ledger.CONFIG_RID, page, **ledger.config_event(side.ledger_config(), _pool_free(side)))
        for req in reqs:
            _prealloc(side, writer, req)
            ledger.assert_clean(_event_violations(writer), f"after prealloc of {req.rid}")
        for req in reqs:
            _release(side, writer, req)
            ledger.assert_clean(_event_violations(writer), f"after release of {req.rid}")

    events = ledger.read(path)
    assert [e.kind for e in events] == ["config"] + ["prealloc"] * len(reqs) + ["release"] * len(reqs)
    ledger.assert_clean(ledger.check(events), "of the whole run")
    assert side.snapshot().free() == side.baseline.free()
