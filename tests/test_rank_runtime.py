"""Publishing sglang's runtime settings for the simulated ranks (``harness.engines.sim.rank_runtime``): settings
published before come back as the state their install built, with the values sglang's code then reads."""

from __future__ import annotations

import pytest

from harness.engines.sim import rank_runtime

pytestmark = pytest.mark.est_time(10)


def test_settings_published_again_are_the_state_their_install_built():
    from sglang.srt.runtime_context import get_context, get_disagg, get_server_args

    # What sglang's decode prealloc reads of them: get_disagg().disaggregation_decode_enable_radix_cache.
    prefill = rank_runtime.RuntimeSettings(radix_cache=False, page_size=16)
    decode = rank_runtime.RuntimeSettings(radix_cache=True, page_size=64)
    rank_runtime.publish(prefill)
    first = get_server_args()
    assert not get_disagg().disaggregation_decode_enable_radix_cache
    rank_runtime.publish(decode)
    assert get_disagg().disaggregation_decode_enable_radix_cache
    rank_runtime.publish(prefill)
    again = get_server_args()
    assert not get_disagg().disaggregation_decode_enable_radix_cache
    if rank_runtime._context_state(get_context()) is not None:  # 0.5.21 on: no second install
        assert again is first
    assert rank_runtime.published() == prefill
