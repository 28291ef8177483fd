"""Per-rank head digests on sglang's real CPU KV pools (no server): a prefill pool of 2 KV heads and decode pools of
1 head per rank, filled the way an unequal-TP transfer fills them, recorded by each rank's writer and matched by
:func:`harness.ledger.head_slices.check`. A rank given another head's bytes is named with the head it got."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from harness.engines.server import kv_digest, kv_heads
from harness.ledger import head_slices

P = 4  # tokens per page
LAYERS = 2
ROOM = 77


def _pool(heads: int):
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    return MHATokenToKVPool(8 * P, P, torch.bfloat16, heads, 16, LAYERS, "cpu", False)


def _views(pool):
    ptrs, _, item_lens = pool.get_contiguous_buf_infos()
    return kv_digest.page_views(pool, ptrs, item_lens)


def _land(prefill, decode, head: int, src: list[int], dst: list[int]) -> None:
    """Copy prefill's ``head`` of pages ``src`` into decode's one slot of pages ``dst`` (what the transfer does)."""
    for s, d in zip(src, dst):
        rows, to = slice(s * P, (s + 1) * P), slice(d * P, (d + 1) * P)
        for layer in range(LAYERS):
            decode.k_buffer[layer][to, 0] = prefill.k_buffer[layer][rows, head]
            decode.v_buffer[layer][to, 0] = prefill.v_buffer[layer][rows, head]


def _run(tmp_path, route: list[int]) -> list[head_slices.Misroute]:
    """Prefill TP 1 (heads 0 and 1) to decode TP 2; decode rank ``r`` is given prefill's head ``route[r]``."""
    torch.manual_seed(0)
    prefill = _pool(2)
    for buf in (*prefill.k_buffer, *prefill.v_buffer):
        buf.copy_(torch.randn_like(buf, dtype=torch.float32).to(buf.dtype))
    src, dst = [1, 2], [5, 3]
    kv_heads.HeadsRecorder(tmp_path, "prefill").record(
        "prefill", room=ROOM, kv_args=SimpleNamespace(engine_rank=0), tp=1, views=_views(prefill), pages=src,
        slots=2, page_size=P,
    )  # fmt: skip
    for rank, head in enumerate(route):
        decode = _pool(1)
        _land(prefill, decode, head, src, dst)
        kv_heads.HeadsRecorder(tmp_path, "decode").record(
            "decode", room=ROOM, kv_args=SimpleNamespace(engine_rank=rank), tp=2, views=_views(decode), pages=dst,
            slots=1, page_size=P,
        )  # fmt: skip

    def holds(side: str, rank: int, tp: int) -> list[int]:
        return [0, 1] if side == "prefill" else [rank]

    return head_slices.check(tmp_path, "prefill", "decode", [ROOM], holds)


def test_each_rank_writes_its_own_file_and_the_right_heads_pass(tmp_path):
    assert _run(tmp_path, [0, 1]) == []
    names = sorted(p.name for p in tmp_path.iterdir())  # <worker>.rank<R>.<pid>.jsonl: one file per process and rank
    assert [n.rsplit(".", 2)[0] for n in names] == ["decode.rank0", "decode.rank1", "prefill.rank0"], names


def test_a_rank_given_the_other_head_is_named_with_the_head_it_got(tmp_path):
    wrong = _run(tmp_path, [0, 0])
    assert [m.line() for m in wrong] == [f"room {ROOM}: decode rank 1 slot 0 holds KV head 0's bytes, not KV head 1's"]


def test_one_changed_value_of_one_slot_is_seen(tmp_path):
    prefill = _pool(2)
    views = _views(prefill)
    before = kv_heads.slot_digests(views, [1, 2], 2, P)
    prefill.v_buffer[0][P + 2, 1, 5] = 3.0  # page 1, token 2, head 1, layer 0's V (buffer 2)
    after = kv_heads.slot_digests(views, [1, 2], 2, P)
    changed = [(b, s, i) for b in range(4) for s in range(2) for i in range(2) if before[b][s][i] != after[b][s][i]]
    assert changed == [(2, 1, 0)]


@pytest.mark.parametrize("missing", ["prefill", "decode"])
def test_a_room_without_records_is_a_misroute_not_a_pass(tmp_path, missing):
    _run(tmp_path, [0, 1])
    for path in tmp_path.glob(f"{missing}.rank*.jsonl"):
        path.unlink()
    wrong = head_slices.check(tmp_path, "prefill", "decode", [ROOM], lambda side, rank, tp: [rank])
    assert [m.what for m in wrong] == [f"no {missing} record (kv_heads/prefill, decode)"]


def test_a_pool_without_head_slots_is_said_once_and_the_room_is_not_passed(tmp_path):
    recorder = kv_heads.HeadsRecorder(tmp_path, "decode")
    pool = _pool(1)
    for _ in range(2):
        recorder.record(
            "decode", room=ROOM, kv_args=SimpleNamespace(engine_rank=1), tp=2, views=_views(pool), pages=[1],
            slots=None, page_size=P,
        )  # fmt: skip
    lines = recorder.path(1).read_text().splitlines()
    assert len(lines) == 1 and recorder.stopped
    wrong = head_slices.check(tmp_path, "prefill", "decode", [ROOM], lambda side, rank, tp: [rank])
    assert [m.what for m in wrong] == [
        'a rank could not record its heads: decode: AttributeError("the KV pool\'s head_num")'
    ]


def test_a_torn_line_and_a_prefill_rank_that_never_sent_are_named(tmp_path):
    _run(tmp_path, [0, 1])
    (decode,) = tmp_path.glob("decode.rank0.*.jsonl")
    decode.write_text(decode.read_text() + '{"side": "decode", "ro')  # a writer stopped mid-line
    wrong = head_slices.check(
        tmp_path, "prefill", "decode", [ROOM], lambda side, rank, tp: [0, 1] if tp == 1 else [rank]
    )
    assert [m.what for m in wrong] == [f"not a record: {decode.name}:2"]
    decode.write_text(decode.read_text().rsplit("\n", 1)[0] + "\n")
    (prefill,) = tmp_path.glob("prefill.rank0.*.jsonl")
    rec = prefill.read_text().replace('"tp": 1', '"tp": 2')  # prefill says TP 2, and only rank 0 recorded
    prefill.write_text(rec)
    wrong = head_slices.check(tmp_path, "prefill", "decode", [ROOM], lambda side, rank, tp: [rank])
    assert [m.what for m in wrong] == ["prefill rank 1 recorded no send"]
