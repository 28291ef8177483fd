"""The soak's verdict (:mod:`harness.pd.soak`): a leak at any checkpoint fails it, naming where, and the
slope is exact; ``--soak`` takes a positive count. The soak itself runs as a suite
(``suites/disaggregation/test_disaggregation_soak.py``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from harness.pd.errors import PDError
from harness.pd.soak import Checkpoint, SoakResult

REPO = Path(__file__).resolve().parent.parent


def _result(leaks: list[int]) -> SoakResult:
    return SoakResult(requests=50 * len(leaks), completed=50 * len(leaks), wall_s=2.0,
                      checkpoints=[Checkpoint(50 * (i + 1), {"full": 0, "swa": leak, "live": 0}, 0)
                                   for i, leak in enumerate(leaks)])


def test_a_balanced_soak_has_slope_zero_and_passes():
    result = _result([0] * 6)
    result.assert_clean()
    assert result.slope == 0.0 and result.requests_per_s == 150.0
    assert result.summary()["max_leak"] == 0


def test_one_slot_not_back_at_one_checkpoint_fails_naming_it():
    result = _result([0, 0, 0, 0, 1, 1])
    with pytest.raises(PDError, match=r"leak after 250 requests: \{'full': 0, 'swa': 1, 'live': 0\} slot\(s\)"):
        result.assert_clean()
    assert result.slope > 0
    assert _result([0, 64, 128, 192]).slope == pytest.approx(1280.0)  # 64 slots per 50 requests


def test_soak_needs_a_positive_count():
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--soak", "0", "--co", "-q",
                           "suites/disaggregation/test_disaggregation_soak.py"], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 4, proc.stdout + proc.stderr
    assert "--soak 0: a soak needs at least 1 request; give a positive number" in proc.stderr
