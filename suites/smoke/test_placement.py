"""Smoke: a prefill and a decode worker placed on the 2-gpu-h100 topology, each on its own GPU."""

from __future__ import annotations

import os

import pytest

from harness.api import InProcess

pytestmark = [pytest.mark.topology("2-gpu-h100"), pytest.mark.est_time(15)]


def test_prefill_and_decode_get_one_gpu_each(pd_workers):
    prefill = pd_workers("prefill", InProcess(dict))
    decode = pd_workers("decode", InProcess(dict))

    assert len(prefill.gpu_ids) == 1 and len(decode.gpu_ids) == 1
    assert set(prefill.gpu_ids) | set(decode.gpu_ids) == {0, 1}
    for w in (prefill, decode):
        assert w.info.cuda_visible_devices == ",".join(map(str, w.gpu_ids))
        assert w.info.pid != os.getpid()
        assert w.log_path.exists()
    # The payload lives in the worker: state set through one call is seen by the next.
    decode.call("update", role="decode")
    assert decode.call("get", "role") == "decode"
