"""The request hold (harness.engines.server.hold): a held request's send waits for its file to
go and says it is waiting; every other request passes at once; only a prefill probe installs it."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

from harness.engines.server import hold
from harness.engines.server.accounting_probe import COMPONENT_ENV, LEDGER_ENV


def _send_log():
    sent: list[str] = []

    def send(self, req, last_chunk=False):
        sent.append(req.rid)
        return "sent"

    return sent, send


def test_a_request_without_a_hold_file_is_sent_at_once(tmp_path):
    sent, send = _send_log()
    hold.hold_file(tmp_path, "other")
    wrapped = hold._wrap_send(tmp_path / "hold", send)
    assert wrapped(None, SimpleNamespace(rid="free"), last_chunk=True) == "sent"
    assert sent == ["free"] and not (tmp_path / "hold" / "free.held").exists()


def test_a_held_request_waits_for_its_release_and_says_it_is_held(tmp_path):
    sent, send = _send_log()
    gate = hold.hold_file(tmp_path, "r1")
    wrapped = hold._wrap_send(tmp_path / "hold", send)
    t = threading.Thread(target=wrapped, args=(None, SimpleNamespace(rid="r1")), kwargs={"last_chunk": True})
    t.start()
    deadline = time.monotonic() + 10
    while not hold.held(gate) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert hold.held(gate), "the send never said it holds the request"
    time.sleep(0.1)
    assert sent == [], "the held request was sent before its release"
    hold.release(gate)
    t.join(10)
    assert sent == ["r1"] and not t.is_alive()
    hold.release(gate)  # idempotent


def test_only_a_prefill_probe_installs_the_hold(tmp_path):
    ledger = str(tmp_path / "ledger" / "prefill.jsonl")
    assert hold.hold_dir(ledger) == tmp_path / "ledger" / "hold"
    assert not hold.install_from_env({LEDGER_ENV: ledger, COMPONENT_ENV: "decode"})
    assert not hold.install_from_env({COMPONENT_ENV: "prefill"})
