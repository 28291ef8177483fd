"""The fault catalog mechanism: names, runtime activation and undo, env parsing, and the source
patches' effect on real sglang code (in a subprocess importing the patched copy)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from harness import faults
from harness.faults import source
from harness.targets.sglang import selection

pytestmark = pytest.mark.est_time(20)


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
        assert fault.upstream and fault.evidence and fault.suites
        if fault.is_patch:
            assert (source.PATCH_DIR / f"{name}.diff").is_file() and not fault.target
        else:
            assert ":" in fault.target and callable(fault.make)


def test_unknown_name_lists_the_known_ones():
    with pytest.raises(faults.FaultError, match="unknown fault 'no-such-fault'.*swa-tail-unaligned"):
        faults.parse_names("swa-tail-unaligned, no-such-fault")


def test_parse_names_strips_blanks_and_duplicates():
    assert faults.parse_names(None) == []
    assert faults.parse_names(" ,") == []
    assert faults.parse_names("release-leaks-swa, swa-tail-unaligned,release-leaks-swa") == [
        "release-leaks-swa",
        "swa-tail-unaligned",
    ]


@pytest.mark.parametrize("name", sorted(n for n, f in faults.catalog().items() if not f.is_patch))
def test_every_runtime_fault_applies_and_undoes(clean_faults, name):
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
    assert faults.activate_from_env({faults.ENV_VAR: "corrupt-kv-page"}) == ["corrupt-kv-page"]
    with pytest.raises(faults.FaultError):
        faults.activate_from_env({faults.ENV_VAR: "typo"})


class _PatchedRun:
    """``code`` running in a subprocess whose sglang is a scratch copy with ``names`` applied."""

    def __init__(self, tmp_path, names, code):
        scratch = source.scratch_copy(names, tmp_path / "scratch", selection.sglang_root().resolve())
        self.fired_path = tmp_path / "fired.txt"
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(scratch), os.environ.get("PYTHONPATH", "")]),
            faults.ENV_VAR: ",".join(names),
            source.FIRED_ENV: str(self.fired_path),
        }
        self.proc = subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(code)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )

    def result(self) -> tuple[str, set[str]]:
        """Wait for it: its output and the faults that fired."""
        try:
            out, err = self.proc.communicate(timeout=600)
        finally:
            self.stop()
        assert self.proc.returncode == 0, err[-3000:]
        return out.strip(), source.fired(self.fired_path)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.communicate()


def _on_patched_copy(tmp_path, names, code):
    """Run ``code`` in a subprocess whose sglang is a scratch copy with ``names`` applied."""
    return _PatchedRun(tmp_path, names, code).result()


def test_swa_tail_patches_move_the_window_start(tmp_path):
    code = """
        from harness.engines.sim import DecodeConfig, DecodeSide
        print(DecodeSide(DecodeConfig(page_size=64, window=100)).swa_tail_len(300))
    """
    # Both copies at once: each child mostly imports sglang, on one core.
    runs = [
        _PatchedRun(tmp_path / "u", ["swa-tail-unaligned"], code),
        _PatchedRun(tmp_path / "s", ["swa-tail-short"], code),
    ]
    try:
        # window start 200: floored to 192 (installed), left at 200 (unaligned), rounded up to 256 (short)
        assert runs[0].result() == ("100", {"swa-tail-unaligned"})
        assert runs[1].result() == ("44", {"swa-tail-short"})
    finally:
        for run in runs:
            run.stop()


def test_release_leaks_swa_keeps_the_swa_pages(tmp_path):
    code = """
        from harness.engines.sim import DecodeConfig, DecodeSide, make_req
        side = DecodeSide(DecodeConfig(page_size=64, window=100))
        req = make_req("leak", 300)
        side.prealloc(req)
        side.release(req)
        print(side.snapshot().taken_since(side.baseline))
    """
    # Full pages came back, the 108-token tail's two SWA pages did not.
    assert _on_patched_copy(tmp_path, ["release-leaks-swa"], code) == ("{'swa': 128}", {"release-leaks-swa"})


def test_an_eviction_that_frees_the_window_is_what_the_probe_reads_and_the_ledger_names(tmp_path):
    """The server probe on real decode steps (page 16, window 40, eviction interval 1): clean, every
    eviction frees exactly the positions below its floor and the ledger is clean; under
    ``swa-evict-frees-window`` the floor sglang records is unchanged, but the slots the eviction really
    freed reach into the window, and the ledger names ``swa-window-lost`` on the request's evict."""
    code = """
        import os
        os.environ["SGLANG_SWA_EVICTION_INTERVAL"] = "1"
        from harness.faults import source
        from harness.engines.server import accounting_probe
        path = os.path.join(os.path.dirname(os.environ[source.FIRED_ENV]), "ledger.jsonl")  # this run's tmp dir
        accounting_probe.install(path, "d0", "decode")  # before sglang is imported, as in a server
        from harness import ledger
        from harness.engines.sim import DecodeConfig, DecodeSide, make_req
        from harness.engines.sim.pd_decode_side import decode_step
        side = DecodeSide(DecodeConfig(page_size=16, window=40))
        req = make_req("r", 100, output_len=1, max_new_tokens=64)
        side.prealloc(req)
        for step in range(24):
            decode_step(side, [req], step)
            req.output_ids.append(7)
        evs = ledger.read(path)
        print([(e.evicted_seqlen, e.freed_spans) for e in evs if e.kind == "evict" and e.freed_spans])
        print([v.headline() for v in ledger.check(evs) if v.rule != ledger.IN_FLIGHT])  # never released: in flight
    """
    runs = [
        _PatchedRun(tmp_path / "clean", [], code),
        _PatchedRun(tmp_path / "fault", ["swa-evict-frees-window"], code),
    ]
    try:
        (clean, _), (broken, fired) = (run.result() for run in runs)
    finally:
        for run in runs:
            run.stop()
    # prealloc floor 48 (fill 100, tail 52); seq 105 and 121 evict a page each, to 64 and to 80
    assert clean.splitlines() == ["[(64, ((48, 64),)), (80, ((64, 80),))]", "[]"]
    spans, found = broken.splitlines()
    assert spans == "[(64, ((48, 80),)), (80, ((80, 96),))]" and fired == {"swa-evict-frees-window"}
    assert found.startswith(
        "['[swa-window-lost] d0 evict of r: seq 105: the eviction freed the SWA slots of 15 "
        "position(s) inside the window [65, 105) ([65, 80); recorded floor 64)'"
    ), found
