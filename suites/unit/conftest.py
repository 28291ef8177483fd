"""Shared fixtures of the unit suites: real sglang decode-side objects from the adapter.

The device comes from env ``HARNESS_DEVICE`` (a Ray worker sets it to its GPU, e.g. ``cuda:0``) and
defaults to ``cpu``. Nothing here replaces sglang code: faults are injected only by the harness's
own tests (``--inject-fault``), never by these suites.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Iterator

import pytest

from harness.api import DecodeConfig, DecodeSide, DEVICE_ENV


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread() -> Iterator[None]:
    """Run torch ops on one intra-op thread while these suites run, then restore.

    The pools' tensors are a few thousand elements; on a busy 2-core machine handing each op to a
    second thread costs several times the op itself. Results do not depend on it.
    """
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def device() -> str:
    """The device to build pools on: ``$HARNESS_DEVICE`` or ``cpu``."""
    return os.environ.get(DEVICE_ENV, "cpu")


@pytest.fixture
def decode_side(device: str) -> Callable[..., DecodeSide]:
    """Factory: ``decode_side(**DecodeConfig fields) -> DecodeSide`` on the session's device."""

    def make(**fields: Any) -> DecodeSide:
        return DecodeSide(DecodeConfig(device=device, **fields))

    return make


@pytest.fixture
def hisparse_side(decode_side: Callable[..., DecodeSide]) -> DecodeSide:
    """The seed's hisparse decode side: DeepSeek-V4 pools, page 256, ``sliding_window_size=200``."""
    return decode_side(hisparse=True, page_size=256, window=200)
