"""Resetting a server between tests (:func:`reset_server`), against a stand-in HTTP server whose
``/flush_cache`` writes the ``reset`` event the real server's probe writes: a violation is raised by
the reset after which it appeared and never again, and a server that only broke a rule judging
sglang's decisions (its pools back at baseline) stays in service, while a leak replaces it."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

from harness import ledger
from harness.ledger import LedgerConfig, LedgerWriter
from harness.engines.server.reset import ResetError, reset_server
from standin_http import StandInHTTP

P = 64
IDLE = {"full": 640, "swa": 320}
#: sglang#35265's reservation: not rounded to whole pages (300 + 512 < 320 + 512): ``reserve-short``.
SHORT_RESERVATION = {"full": 300 + 512, "swa": 108 + 512}


class StandIn:
    """A server's HTTP face and its probe's ledger: each ``/flush_cache`` records the next queued reset."""

    def __init__(self, path: Path) -> None:
        self.name = "decode-0"
        self.writer = LedgerWriter(path, self.name, "decode")
        self.resets: list[dict] = []
        self.after_flush: list[str] = []  # rids preallocated right after the next flush (a health probe)
        self.http = StandInHTTP(self._flushed)

    def _flushed(self, path: str, body: bytes) -> None:
        before, after = self.resets.pop(0)
        self.writer.record("reset", "<flush>", P, free_before=before, free_after=after)
        while self.after_flush:
            self.writer.record("prealloc", self.after_flush.pop(0), P, pages={"full": (9,)})

    def url(self, kind: str) -> str:
        return self.http.url(kind)

    def check(self) -> None:
        """Alive (a real worker raises WorkerDied here)."""

    def request(self, rid: str, reserved: dict) -> None:
        """One request preallocated (fill 300, window 100: full pages 0-4, SWA tail pages 7, 8) and released."""
        self.writer.record(
            "prealloc",
            rid,
            P,
            fill_len=300,
            swa_tail_len=108,
            evicted_seqlen=192,
            reserved=reserved,
            pages={"full": (0, 1, 2, 3, 4), "swa": (7, 8)},
            free_before=IDLE,
            free_after={"full": 320, "swa": 192},
        )
        self.writer.record(
            "release",
            rid,
            P,
            pages={"full": (0, 1, 2, 3, 4), "swa": (7, 8)},
            free_before={"full": 320, "swa": 192},
            free_after=IDLE,
        )


@pytest.fixture
def server(tmp_path: Path) -> Iterator[StandIn]:
    s = StandIn(tmp_path / "decode-0.jsonl")
    cfg = LedgerConfig(page_size=P, window=100, swa_tail=True, decode_reserve=512, swa_decode_reserve=512)
    s.writer.record("config", ledger.CONFIG_RID, P, **ledger.config_event(cfg, IDLE))
    yield s
    s.http.close()
    s.writer.close()


def reset(s: StandIn, before: dict = IDLE, after: dict = IDLE) -> None:
    s.resets.append((before, after))
    reset_server(s, s.writer.path, timeout_s=10)


def test_a_judgement_rule_is_raised_once_and_leaves_the_server_in_service(server):
    server.request("a", SHORT_RESERVATION)
    with pytest.raises(ResetError, match=r"\[reserve-short\].*rid=a") as exc:
        reset(server)
    assert exc.value.reusable, "a server back at baseline that only under-reserved was taken out of service"
    reset(server)  # what the last reset already raised is not raised again
    server.request("b", {"full": 320 + 512, "swa": 128 + 512})
    reset(server)
    server.request("c", SHORT_RESERVATION)
    with pytest.raises(ResetError, match=r"rid=c") as exc:
        reset(server)
    assert "rid=a" not in str(exc.value), exc.value


def test_a_leak_takes_the_server_out_of_service(server):
    server.request("a", SHORT_RESERVATION)
    with pytest.raises(ResetError) as exc:  # a slot neither free nor cached, beside the under-reservation
        reset(server, before={"full": 576, "swa": 320})
    assert "[reset-leak]" in str(exc.value) and not exc.value.reusable, exc.value


def test_a_request_that_arrives_after_the_flush_is_in_flight_and_not_judged(server):
    # A health probe preallocated between the flush and the reading of the ledger: in flight, no leak.
    server.request("a", {"full": 320 + 512, "swa": 128 + 512})
    server.after_flush.append("HEALTH_CHECK_1")
    reset(server)
    assert [v.rule for v in ledger.check(ledger.read(server.writer.path))] == [ledger.IN_FLIGHT]


def test_a_request_holding_pages_across_the_flush_is_a_leak(server):
    # sglang flushes only an idle server: a request still holding its pages then had finished.
    server.writer.record("prealloc", "a", P, pages={"full": (0, 1)})
    with pytest.raises(ResetError, match=r"\[page-leak\].*rid=a") as exc:
        reset(server)
    assert not exc.value.reusable and "in-flight" not in str(exc.value), exc.value
