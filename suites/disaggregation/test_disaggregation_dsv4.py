"""TP4 prefill + TP4 decode over Ray on the 8-GPU H200 topology with DeepSeek-V4 pools (page 256).

Every rank is its own worker holding its shard (the KV content mixes in the rank, so a rank→rank
mix-up fails verification); hisparse on the decode side on and off.
"""

from __future__ import annotations

import pytest

from harness.api import KVSpec, PDRequest, expect, run

pytestmark = [pytest.mark.topology("8-gpu-h200"), pytest.mark.est_time(240), pytest.mark.timeout(900)]

PAGE, WINDOW = 256, 128


@pytest.mark.parametrize("hisparse", [False, True], ids=["hisparse-off", "hisparse-on"])
def test_dsv4_tp4_prefill_to_tp4_decode(pd_pair, pd_report, hisparse):
    spec = KVSpec(
        kind="dsv4",
        page_size=PAGE,
        window=WINDOW,
        hisparse=hisparse,
        full_tokens=16 * PAGE,
        swa_tokens=8 * PAGE,
        req_slots=4,
        max_context_len=4096,
    )
    pair = pd_pair(spec)
    assert len(pair.prefill) == len(pair.decode) == 4
    lengths = [1, PAGE - 1, PAGE, PAGE + 1, 385, 700, 3 * PAGE + 1]
    reqs = [PDRequest(f"v{n}", n, decode_steps=4) for n in lengths]
    res = run(pair, reqs, chunk_pages=2)
    pd_report(res)
    res.assert_clean()
    assert sorted(res.completed) == sorted(r.rid for r in reqs)
    decode_ranks = {e.worker for e in res.events if e.component == "decode"}
    assert len(decode_ranks) == 4
    tails = {e.rid: e for e in res.events if e.component == "decode" and e.kind == "prealloc"}
    # sglang's numbers for page 256 / window 128: fill 385 -> tail 129 (evicted 256); 700 -> 188 (512).
    for rid, tail, evicted in (("v385", 129, 256), ("v700", 188, 512)):
        expect(
            f"decode prealloc of {rid}",
            swa_tail_len=(tails[rid].swa_tail_len, tail),
            evicted_seqlen=(tails[rid].evicted_seqlen, evicted),
        )
