"""One in-process PD pair (a prefill and a decode rank on real sglang pools, no Ray) for the tests of the
PD path: import ``SPEC`` and the module-scoped fixture ``pair`` into a test module."""

from __future__ import annotations

import pytest

from harness.engines.sim.decode_rank import DecodeWorker
from harness.engines.sim.prefill_rank import PrefillWorker
from harness.engines.sim.ranks import Ranks
from harness.engines.sim.driver import PDPair
from harness.engines.sim.workload import KVSpec

SPEC = KVSpec(kind="swa", page_size=64, window=100, full_tokens=32 * 64, swa_tokens=12 * 64, req_slots=8)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    run_dir = str(tmp_path_factory.mktemp("pd-pair"))
    prefill, decode = PrefillWorker("prefill-0", 0, SPEC, run_dir), DecodeWorker("decode-0", 0, SPEC, run_dir)
    yield PDPair(Ranks([prefill]), Ranks([decode]))
    prefill.close()
    decode.close()
