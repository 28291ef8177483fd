"""Allocation order as a knob (issue 47 item 6): under ``lifo`` a page freed early is the next one handed
out, on the simulated sides' real allocators and in a server process (its ``sitecustomize`` patch), and not
under sglang's own order; the knobs (``HARNESS_ALLOC_ORDER``, ``HARNESS_POOL_PAGES``) reach both engines."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from harness import topology
from harness.engines import alloc_order
from harness.engines.server.launcher import ServerPorts, server_command
from harness.engines.sim import DecodeConfig, DecodeSide, make_req
from harness.engines.sim.pools import PoolSizes
from harness.engines.sim.prefill_side import PrefillSide
from harness.engines.sim.workload import KVSpec

P = 16


def _first_page(result) -> int:
    return int(result.destination[0]) // P


@pytest.mark.parametrize("order", ["lifo", "sglang"])
def test_decode_hands_out_the_page_freed_last_under_lifo_only(order):
    side = DecodeSide(DecodeConfig(page_size=P, window=40, alloc_order=order))
    early = make_req("early", 3 * P, output_len=1)
    freed = _first_page(side.prealloc(early))
    side.prealloc(make_req("other", 3 * P, output_len=1))
    side.release(early)
    again = _first_page(side.prealloc(make_req("next", 3 * P, output_len=1)))
    assert (again == freed) == (order == "lifo"), (order, freed, again)


@pytest.mark.parametrize("order", ["lifo", "sglang"])
def test_prefill_hands_out_the_page_freed_last_under_lifo_only(order):
    side = PrefillSide("swa", P, 40, PoolSizes(full_tokens=32 * P, swa_tokens=32 * P), "cpu", order)
    early = side.alloc("early", 2 * P)
    freed = int(side.locs(early, 0, 1)[0][0]) // P
    side.alloc("other", 2 * P)
    side.release(early)
    again = int(side.locs(side.alloc("next", 2 * P), 0, 1)[0][0]) // P
    assert (again == freed) == (order == "lifo"), (order, freed, again)


def test_the_knobs_reach_the_simulated_spec(monkeypatch):
    monkeypatch.setenv(alloc_order.ORDER_ENV, "LIFO")
    monkeypatch.setenv(alloc_order.POOL_PAGES_ENV, "12")
    spec = KVSpec(page_size=64, swa_tokens=16 * 64)
    assert (spec.alloc_order, spec.full_tokens, spec.swa_tokens) == ("lifo", 12 * 64, 12 * 64)
    assert spec.tag.endswith("-lifo-n12")
    monkeypatch.setenv(alloc_order.ORDER_ENV, "fifo")
    with pytest.raises(ValueError, match="HARNESS_ALLOC_ORDER='fifo': use one of sglang, lifo"):
        KVSpec()
    monkeypatch.delenv(alloc_order.ORDER_ENV)
    monkeypatch.setenv(alloc_order.POOL_PAGES_ENV, "1")
    with pytest.raises(ValueError, match="at least 2 pages"):
        KVSpec()


def _command(role: str = "decode", **kwargs):
    return server_command(topology.get("cpu"), role, model="/m", ports=ServerPorts(1, 2, 3), **kwargs)


def _flag(argv, flag: str) -> str:
    return argv[len(argv) - 1 - argv[::-1].index(flag) + 1]


def test_the_knobs_reach_a_servers_command(monkeypatch):
    assert _flag(_command().argv, "--max-total-tokens") == "8192"  # the CPU recipe's own pool
    monkeypatch.setenv(alloc_order.ORDER_ENV, "lifo")
    monkeypatch.setenv(alloc_order.POOL_PAGES_ENV, "12")
    cmd = _command()
    assert cmd.argv.count("--max-total-tokens") == 1 and _flag(cmd.argv, "--max-total-tokens") == str(12 * 64)
    assert cmd.env[alloc_order.ORDER_ENV] == "lifo"
    explicit = _command(extra_args=("--max-total-tokens", "4096"))
    assert _flag(explicit.argv, "--max-total-tokens") == "4096"  # a test's own flag wins


def test_a_server_process_installs_lifo_through_sitecustomize(monkeypatch):
    """What a real server's sitecustomize does under ``HARNESS_ALLOC_ORDER=lifo``: sglang's allocator
    classes patched at import, and a real paged allocator of a PD worker (``need_sort=True``) hands out the
    page it freed last."""
    monkeypatch.setenv(alloc_order.ORDER_ENV, "lifo")
    code = """
        import torch
        from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator as Paged
        assert hasattr(Paged._release_page_ids, "__wrapped__")
        a = Paged(16 * 4, 4, torch.float16, "cpu", None, need_sort=True)
        x = a.alloc(8)
        a.alloc(8)
        a.free(x[:4])
        print("freed", int(x[0]) // 4, "next", int(a.alloc(4)[0]) // 4)
    """
    cmd = _command(compat_patches=())
    r = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], env=cmd.environ(), capture_output=True, text=True, timeout=240
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "freed 1 next 1" in r.stdout, r.stdout
