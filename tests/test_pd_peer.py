"""The store-free P→D transport (:mod:`harness.engines.sim.peer`), in this process on real sglang pools: KV
written straight into the decode pages over Mooncake arrives byte for byte (decode's commit
verifies it), a corrupted page is caught on this path, the object store is the fallback when the
transport cannot be set up, a write into a gone decode rank fails at once (naming a dead worker),
and opening and closing endpoints leaves no port, connection or thread.
"""

from __future__ import annotations

import logging
import sys

import psutil
import pytest

from harness import faults
from harness.engines.sim import peer
from harness.engines.sim.decode_rank import KVCorruption
from harness.engines.sim.errors import PDError
from harness.engines.sim.driver import run
from harness.engines.sim.workload import PDRequest
from pdpair import SPEC, pair  # noqa: F401 - the module's fixture (F811 where a test or fixture takes it)
from harness.engines.sim.kv_transfer import plan, transfer
from harness.workers import WorkerDied

pytest.importorskip("mooncake.engine", reason="the store-free transport needs mooncake's transfer engine")

REQS = [
    PDRequest("r300", 300, decode_steps=20),
    PDRequest("r129", 129, decode_steps=5),
    PDRequest("r64", 64, decode_steps=3),
]


@pytest.fixture
def writes(pair, monkeypatch):  # noqa: F811
    """Counts the decode rank's ``write_chunk`` calls (the object-store path's receiving end)."""
    decode = pair.decode.members[0]
    count = {"n": 0}
    original = decode.write_chunk

    def counted(*args):
        count["n"] += 1
        return original(*args)

    monkeypatch.setattr(decode, "write_chunk", counted)
    return count


def _fresh(pair, monkeypatch, transport):  # noqa: F811
    monkeypatch.setenv(peer.MODE_ENV, transport)
    pair.decode.members[0].live.clear()
    pair.prefill.members[0].reqs.clear()
    pair.configure(SPEC)
    return pair


def _sockets() -> tuple[list[int], int]:
    me = psutil.Process()
    return sorted(c.laddr.port for c in me.net_connections("tcp") if c.status == psutil.CONN_LISTEN), len(
        me.net_connections("tcp")
    )


def test_kv_moves_over_the_peer_transport_and_is_verified(pair, writes, monkeypatch):  # noqa: F811
    p = _fresh(pair, monkeypatch, "peer")
    assert p.link is not None and p.link.targets[0]["session"]
    res = run(p, REQS)
    res.assert_clean()
    assert sorted(res.completed) == sorted(r.rid for r in REQS)
    assert res.bytes > 0 and writes["n"] == 0  # every page went peer to peer, none through write_chunk
    # The store path in the same process still moves (and verifies) the same workload.
    p = _fresh(pair, monkeypatch, "store")
    assert p.link is None
    run(p, REQS).assert_clean()
    assert writes["n"] > 0


def test_a_corrupted_page_is_caught_on_the_peer_transport(pair, writes, monkeypatch):  # noqa: F811
    p = _fresh(pair, monkeypatch, "peer")
    before = set(faults.active())
    faults.activate(["corrupt-kv-page"])
    try:
        with pytest.raises(KVCorruption) as info:
            run(p, REQS[:1])
    finally:
        faults.deactivate([n for n in faults.active() if n not in before])
    assert writes["n"] == 0 and "r300" in str(info.value) and "after transfer" in str(info.value)


def test_the_store_is_the_fallback_when_the_transport_cannot_be_set_up(pair, writes, monkeypatch, caplog):  # noqa: F811
    pair.prefill.members[0].peer_close()
    pair.decode.members[0].peer_close()
    monkeypatch.setitem(sys.modules, "mooncake.engine", None)  # as if mooncake were not installed
    monkeypatch.setattr(peer, "_warned", set())
    with caplog.at_level(logging.WARNING, logger="harness.engines.sim.peer"):
        p = _fresh(pair, monkeypatch, "auto")
        p = _fresh(pair, monkeypatch, "auto")  # the same reason again: no second line
    lines = [r.getMessage() for r in caplog.records if r.name == "harness.engines.sim.peer"]
    assert p.link is None and len(lines) == 1 and "object store" in lines[0] and "mooncake.engine" in lines[0], lines
    run(p, REQS[:2]).assert_clean()
    assert writes["n"] > 0
    with pytest.raises(PDError, match="HARNESS_PD_TRANSPORT=peer"):
        _fresh(pair, monkeypatch, "peer")


def test_a_write_into_a_gone_decode_rank_fails_at_once_naming_the_dead_worker(pair, monkeypatch):  # noqa: F811
    p = _fresh(pair, monkeypatch, "peer")
    dst = p.decode.all("admit", "gone", 300, 1)
    src = p.prefill.all("prefill", "gone", 300)
    p.decode.members[0].peer_close()  # its engine and ports gone, as when the decode process dies
    with pytest.raises(RuntimeError, match="mooncake write of .* returned"):  # an error, not a hang
        transfer(p.prefill, p.decode, "gone", plan(src, dst, 4), p.page_bytes, max_inflight_bytes=1 << 20, link=p.link)

    def dead() -> None:  # what Ranks.check raises for a dead Ray worker
        raise WorkerDied("decode-0", "actor died", "")

    monkeypatch.setattr(p.decode, "check", dead)
    with pytest.raises(WorkerDied):
        transfer(p.prefill, p.decode, "gone", plan(src, dst, 4), p.page_bytes, max_inflight_bytes=1 << 20, link=p.link)
    p.prefill.all("release", "gone")
    p.decode.all("abort", "gone")


def test_a_bad_transport_name_is_one_clear_error(monkeypatch):
    monkeypatch.setenv(peer.MODE_ENV, "rdma")
    with pytest.raises(
        ValueError, match="HARNESS_PD_TRANSPORT='rdma' is not a P→D transport; use one of auto, peer, store"
    ):
        peer.mode()


def test_endpoints_open_and_close_without_leaking_ports_connections_or_threads(pair, monkeypatch):  # noqa: F811
    _fresh(pair, monkeypatch, "store")  # endpoints closed
    _fresh(pair, monkeypatch, "peer")
    _fresh(pair, monkeypatch, "store")  # mooncake's process-wide threads exist from here on
    ports, conns = _sockets()
    threads = psutil.Process().num_threads()
    for _ in range(5):
        p = _fresh(pair, monkeypatch, "peer")
        session = p.link.targets[0]["session"]
        assert int(session.rsplit(":", 1)[1]) in _sockets()[0]  # the decode endpoint listens while open
        run(p, REQS[2:]).assert_clean()
        _fresh(pair, monkeypatch, "store")
        assert _sockets() == (ports, conns)
    assert psutil.Process().num_threads() == threads
