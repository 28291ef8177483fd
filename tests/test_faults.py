"""The fault catalog mechanism: names, activation on the running sglang code, undo, env parsing."""

from __future__ import annotations

import pytest

from harness import faults


@pytest.fixture
def clean_faults():
    """No fault active before or after the test (the suites must never inherit one)."""
    assert faults.active() == [], "a fault leaked into this session"
    yield
    faults.deactivate()


def test_catalog_entries_are_complete():
    known = faults.catalog()
    assert {"swa-tail-unaligned", "release-leaks-swa"} <= set(known)
    for name, fault in known.items():
        assert fault.name == name and name == name.lower() and " " not in name
        assert fault.description and "\n" not in fault.description
        assert fault.upstream and ":" in fault.target and callable(fault.make)


def test_unknown_name_lists_the_known_ones():
    with pytest.raises(faults.FaultError, match="unknown fault 'no-such-fault'.*swa-tail-unaligned"):
        faults.parse_names("swa-tail-unaligned, no-such-fault")


def test_parse_names_strips_blanks_and_duplicates():
    assert faults.parse_names(None) == []
    assert faults.parse_names(" ,") == []
    assert faults.parse_names("release-leaks-swa, swa-tail-unaligned,release-leaks-swa") == [
        "release-leaks-swa", "swa-tail-unaligned"]


@pytest.mark.parametrize("name", sorted(faults.catalog()))
def test_every_fault_applies_to_the_installed_sglang_and_undoes(clean_faults, name):
    import importlib

    fault = faults.get(name)
    module_name, _, qualname = fault.target.partition(":")
    owner = importlib.import_module(module_name)
    *path, attr = qualname.split(".")
    for part in path:
        owner = getattr(owner, part)
    original = vars(owner)[attr]

    assert name in faults.activate([name])
    assert vars(owner)[attr] is not original

    faults.deactivate([name])
    assert vars(owner)[attr] is original
    assert name not in faults.active()


def test_activate_from_env_reads_harness_faults(clean_faults):
    assert faults.activate_from_env({}) == []
    assert faults.activate_from_env({faults.ENV_VAR: "swa-tail-unaligned"}) == ["swa-tail-unaligned"]
    with pytest.raises(faults.FaultError):
        faults.activate_from_env({faults.ENV_VAR: "typo"})


def test_swa_tail_unaligned_drops_the_page_floor(clean_faults):
    from harness.targets.sglang import DecodeConfig, DecodeSide

    side = DecodeSide(DecodeConfig(page_size=64, window=100))
    assert side.swa_tail_len(300) == 108  # window start 200 floored to 192
    faults.activate(["swa-tail-unaligned"])
    assert side.swa_tail_len(300) == 100  # 300 - 100 = 200 evicted: not a multiple of 64
    faults.deactivate(["swa-tail-unaligned"])
    assert side.swa_tail_len(300) == 108


def test_release_leaks_swa_keeps_the_swa_pages(clean_faults):
    from harness.targets.sglang import DecodeConfig, DecodeSide, make_req

    side = DecodeSide(DecodeConfig(page_size=64, window=100))
    faults.activate(["release-leaks-swa"])
    req = make_req("leak", 300)
    side.prealloc(req)
    side.release(req)
    # Full pages came back, the 108-token tail's two SWA pages did not.
    assert side.snapshot().taken_since(side.baseline) == {"swa": 128}
