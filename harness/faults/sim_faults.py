"""The runtime fault of the harness's own PD transfer: a prefill that ships one corrupted KV page.

A patch cannot express it (the transfer is the harness's, not sglang's), so it replaces
``harness.engines.sim.kvfill:pack_pages`` in the running prefill worker. Registered in :mod:`harness.faults.names`.
"""

from __future__ import annotations

import os
from typing import Any, Callable

from harness.faults.fault import Fault
from harness.faults.source import FIRED_ENV

NAME = "corrupt-kv-page"


def _corrupt_first_page(original: Callable[..., Any]) -> Callable[..., Any]:
    """``pack_pages`` that flips one byte of the first page it ever packs (one corrupted page)."""
    state = {"done": False}

    def pack_pages(views: list, page_ids: list) -> Any:
        arrays = original(views, page_ids)
        if not state["done"] and arrays and arrays[0].size:
            state["done"] = True
            arrays[0] = arrays[0].copy()  # the shipped copy only: the prefill's own page stays intact
            arrays[0].reshape(-1)[0] ^= 0xFF
            if os.environ.get(FIRED_ENV):  # the same proof a patch's marker line gives
                with open(os.environ[FIRED_ENV], "a", encoding="utf-8") as fh:
                    fh.write(NAME + "\n")
        return arrays

    return pack_pages


FAULTS: tuple[Fault, ...] = (
    Fault(
        name=NAME,
        description="the prefill ships one KV page with a flipped byte",
        upstream="transfer-engine corruption class (e.g. mooncake partial writes)",
        evidence=("KVCorruption",),
        suites=(
            "suites/disaggregation/test_disaggregation_basic.py::test_mixed_prompt_lengths_around_page_boundaries",
        ),
        est_s=18,
        target="harness.engines.sim.kvfill:pack_pages",
        make=_corrupt_first_page,
    ),
)
