"""Pure parts of the PD path (no sglang, no Ray): workload, KV content, page moves, transfer plan."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from harness.engines.sim import kvfill
from harness.engines.sim.ranks import Ranks
from harness.engines.sim.workload import KVSpec, PDRequest, workload
from harness.engines.sim.kv_transfer import Chunk, merge, messages, plan, transfer


def test_workload_is_seeded_and_clusters_at_page_boundaries():
    a = workload(7, 300, page_size=64, max_prompt=384, abort_rate=0.1)
    assert a == workload(7, 300, page_size=64, max_prompt=384, abort_rate=0.1)
    assert a != workload(8, 300, page_size=64, max_prompt=384, abort_rate=0.1)
    near = sum(1 for r in a if r.prompt_len % 64 in (63, 0, 1))
    assert near > len(a) // 2
    assert all(1 <= r.prompt_len <= 384 for r in a)
    assert 0 < sum(r.abort_after_chunks is not None for r in a) < 100
    with pytest.raises(ValueError, match="at least one page"):
        workload(1, 1, page_size=64, max_prompt=10)


def test_kvspec_validates():
    with pytest.raises(ValueError, match="multiple of page_size"):
        KVSpec(page_size=64, full_tokens=100)
    with pytest.raises(ValueError, match="hisparse needs"):
        KVSpec(kind="swa", hisparse=True)
    assert (
        KVSpec(kind="dsv4", page_size=256, window=128, hisparse=True, full_tokens=4096, swa_tokens=2048).tag
        == "dsv4-p256-w128-hisparse"
    )


def _views(pages=6, page_size=4, token_bytes=3):
    return [torch.zeros(pages, page_size * token_bytes + 2, dtype=torch.uint8) for _ in range(2)]


def test_content_write_verify_and_mismatch_names_the_position():
    views = _views()
    pos = torch.arange(8)
    pages, slots = pos // 4 + 1, pos % 4
    kvfill.write(views, 4, 0, seed=11, positions=pos, pages=pages, slots=slots)
    assert kvfill.verify(views, 4, 0, 11, pos, pages, slots) is None
    assert kvfill.verify(views, 4, 0, 12, pos, pages, slots) is not None  # another request's seed
    views[1][2, 5] ^= 1  # page 2, slot 1 of buffer 1 -> position 5
    bad = kvfill.verify(views, 4, 0, 11, pos, pages, slots)
    assert (bad.buffer, bad.position, bad.page, bad.slot) == (1, 5, 2, 1)


def test_gather_scatter_moves_whole_pages_to_other_page_ids():
    src, dst = _views(), _views()
    pos = torch.arange(8)
    kvfill.write(src, 4, 0, 3, pos, pos // 4 + 1, pos % 4)
    data = [a.copy() for a in kvfill.pack_pages(src, [1, 2])]
    for a in data:
        a.setflags(write=False)  # what Ray hands the receiver
    assert kvfill.unpack_pages(dst, [4, 3], data) == 2 * sum(v.shape[1] for v in dst)
    assert kvfill.verify(dst, 4, 0, 3, pos, torch.tensor([4] * 4 + [3] * 4), pos % 4) is None
    with pytest.raises(ValueError, match="shapes"):
        kvfill.unpack_pages(dst, [4], data)


def test_per_row_seeds_check_many_requests_in_one_pass_and_name_the_row():
    views = _views(pages=8)
    pos = torch.arange(8)
    pages, slots = pos // 4 + 1, pos % 4
    seeds = torch.tensor([5] * 4 + [9] * 4)  # two requests, one page each
    kvfill.write(views, 4, 0, seeds, pos, pages, slots)
    assert kvfill.verify(views, 4, 0, 5, pos[:4], pages[:4], slots[:4]) is None  # same bytes as one seed
    assert kvfill.verify(views, 4, 0, seeds, pos, pages, slots) is None
    views[0][2, 3 * 3] ^= 1  # page 2 slot 3: the second request's last token
    bad = kvfill.verify(views, 4, 0, seeds, pos, pages, slots)
    assert (bad.buffer, bad.position, bad.page, bad.slot, bad.index) == (0, 7, 2, 3, 7)


@pytest.mark.parametrize(
    "src_pages,dst_pages",
    [([1, 2, 3, 4], [5, 6, 7, 8]), ([4, 1, 3, 2], [8, 5, 6, 7]), ([1, 2, 3, 4], [8, 2, 7, 6])],
    ids=["runs", "scattered-src", "scattered-dst"],
)
def test_gather_scatter_is_the_same_for_page_runs_and_scattered_pages(src_pages, dst_pages):
    src, dst = _views(pages=10), _views(pages=10)
    pos = torch.arange(16)
    kvfill.write(src, 4, 0, 3, pos, torch.tensor(src_pages).repeat_interleave(4), pos % 4)
    packed = kvfill.pack_pages(src, src_pages)
    assert all(np.shares_memory(a, v.numpy()) for a, v in zip(packed, src)) == (src_pages == [1, 2, 3, 4])
    kvfill.unpack_pages(dst, dst_pages, packed)
    assert kvfill.verify(dst, 4, 0, 3, pos, torch.tensor(dst_pages).repeat_interleave(4), pos % 4) is None
    untouched = [p for p in range(10) if p not in dst_pages]
    assert all(int(v[untouched].sum()) == 0 for v in dst)


def test_kv_heads_are_sharded_over_tp_ranks():
    spec = KVSpec(kind="swa", kv_heads=8)
    assert [spec.heads_per_rank(tp) for tp in (1, 2, 4, 8)] == [8, 4, 2, 1]
    with pytest.raises(ValueError, match="TP 3 does not divide kv_heads=8"):
        spec.heads_per_rank(3)
    assert KVSpec(kind="dsv4", page_size=256, window=128, full_tokens=4096, swa_tokens=2048).heads_per_rank(4) == 1
    with pytest.raises(ValueError, match="kv_heads=0"):
        KVSpec(kv_heads=0)


def test_plan_chunks_full_then_swa_and_interleaves_ranks():
    src = [{"full": [10, 11, 12], "swa": [0, 5, 6]}] * 2
    dst = [{"full": {0: 1, 1: 2, 2: 3}, "swa": {1: 7, 2: 8}}] * 2
    chunks = plan(src, dst, chunk_pages=2)
    assert [c.rank for c in chunks] == [0, 1, 0, 1, 0, 1]
    assert chunks[0].src() == [("full", [10, 11])] and chunks[0].dst() == [("full", [1, 2])]
    assert chunks[2].src() == [("full", [12]), ("swa", [5])]  # a chunk carries both pools
    assert chunks[2].dst() == [("full", [3]), ("swa", [7])]
    assert chunks[-1].src() == [("swa", [6])] and chunks[-1].dst() == [("swa", [8])]
    assert chunks[2].nbytes({"full": 100, "swa": 10}) == 110
    assert len(plan(src, dst, chunk_pages=8)) == 2  # one chunk per rank


class _Side:
    """A stand-in rank holding one page buffer (tests the transfer loop, not sglang)."""

    def __init__(self):
        self.views = _views(pages=8)
        self.writes = 0

    def read_chunk(self, rid, parts):
        [(_, pages)] = parts
        return kvfill.pack_pages(self.views, pages)

    def write_chunk(self, rid, parts, data):
        [(_, pages)] = parts
        self.writes += 1
        return kvfill.unpack_pages(self.views, pages, data)


def test_transfer_moves_every_chunk_and_stops_at_an_abort():
    p, d = _Side(), _Side()
    pos = torch.arange(16)
    kvfill.write(p.views, 4, 0, 9, pos, pos // 4 + 1, pos % 4)
    page_bytes = {"full": sum(v.shape[1] for v in p.views)}
    chunks = [Chunk(0, (("full", (1, 2), (5, 6)),)), Chunk(0, (("full", (3, 4), (1, 2)),))]
    st = transfer(Ranks([p]), Ranks([d]), "r", chunks, page_bytes, max_inflight_bytes=1)
    # a bound below one chunk: every chunk is its own message, one in flight at a time
    assert (st.chunks, st.messages, st.bytes, st.aborted, d.writes) == (2, 2, 4 * page_bytes["full"], False, 2)
    assert kvfill.verify(d.views, 4, 0, 9, pos, torch.tensor([5] * 4 + [6] * 4 + [1] * 4 + [2] * 4), pos % 4) is None
    d = _Side()
    st = transfer(Ranks([p]), Ranks([d]), "r", chunks, page_bytes, max_inflight_bytes=1 << 20)
    # both chunks fit the bound: one message, one write, the same bytes at the same pages
    assert (st.chunks, st.messages, st.bytes, d.writes) == (2, 1, 4 * page_bytes["full"], 1)
    assert kvfill.verify(d.views, 4, 0, 9, pos, torch.tensor([5] * 4 + [6] * 4 + [1] * 4 + [2] * 4), pos % 4) is None
    st = transfer(Ranks([p]), Ranks([d]), "r", chunks, page_bytes, max_inflight_bytes=1 << 20, abort_after=1)
    assert (st.chunks, st.messages, st.aborted) == (1, 1, True)
    st = transfer(Ranks([p]), Ranks([d]), "r", chunks, page_bytes, max_inflight_bytes=1 << 20, abort_after=2)
    assert (st.chunks, st.aborted) == (2, False)  # an abort after the last chunk is no abort


def test_messages_batch_chunks_per_rank_within_each_ranks_share_of_the_bound():
    src = [{"full": list(range(10, 20)), "swa": list(range(30, 34))}] * 2
    dst = [{"full": {j: 100 + j for j in range(10)}, "swa": {j: 200 + j for j in range(4)}}] * 2
    chunks = plan(src, dst, chunk_pages=2)  # per rank: 5 full chunks, then 2 swa chunks; 14 in all
    pb = {"full": 100, "swa": 10}
    # 2 ranks share 800 bytes: 400 each, i.e. two 2-page full chunks per message
    msgs = messages(chunks, pb, max_inflight_bytes=800)
    assert [(m.rank, n) for m, n in msgs] == [(0, 2), (1, 2), (0, 2), (1, 2), (0, 3), (1, 3)]
    assert all(m.nbytes(pb) <= 400 for m, _ in msgs)
    assert msgs[0][0].src() == [("full", [10, 11, 12, 13])] and msgs[0][0].dst() == [("full", [100, 101, 102, 103])]
    # the last message carries a full chunk and both swa chunks: one part per pool, in order
    assert msgs[4][0].src() == [("full", [18, 19]), ("swa", [30, 31, 32, 33])]
    assert msgs[4][0].dst() == [("full", [108, 109]), ("swa", [200, 201, 202, 203])]
    # every page once, in the same pairing as the chunks
    pairs = lambda cs: sorted((c.rank, pool, a, b) for c in cs for pool, s, d in c.parts for a, b in zip(s, d))  # noqa: E731
    assert pairs(m for m, _ in msgs) == pairs(chunks)
    # a large bound: one message per rank; a tiny one: one per chunk (a chunk over the share goes alone)
    assert [n for _, n in messages(chunks, pb, 1 << 30)] == [7, 7]
    assert [n for _, n in messages(chunks, pb, 1)] == [1] * 14
    with pytest.raises(ValueError, match="chunks of one rank"):
        merge([chunks[0], chunks[1]])


def test_requests_are_plain_values():
    assert PDRequest("a", 5) == PDRequest("a", 5, decode_steps=4)
