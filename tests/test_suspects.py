"""Where to look: every function the suspect map names exists in every supported release's source,
except the absences listed here, which a failure on that release says as "not in this release".

Each release's source is read from its wheel (downloaded once with ``pip download --no-deps`` into
the target cache, like the releases ``--sglang`` installs; the installed 0.5.23 is read in place).
Nothing is imported: the map is checked with :mod:`ast`, as failures name it.
"""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest

from harness.ledger.rules import KNOCK_ONS, RULES
from harness.targets.sglang import releases
from harness.targets.sglang import selection as target
from harness.targets.sglang.compat import suspects as mod
from wheels import sglang_wheel

pytestmark = pytest.mark.est_time(20)

_, MINOR, OLDEST = releases.OLDEST_RELEASE
SUPPORTED = tuple(f"0.{MINOR}.{n}" for n in range(OLDEST, releases.NEWEST_CHECKED[2] + 1))
#: What a supported release does not have (the map names it for the newer ones).
ABSENT = (
    {(v, "SWATokenToKVPoolAllocator._free_swa_pages") for v in ("0.5.16", "0.5.17", "0.5.18", "0.5.19")}
    # the deferred release and its drain ack came in 0.5.19; decode's metadata step in 0.5.21
    | {
        (v, f)
        for v in ("0.5.16", "0.5.17", "0.5.18")
        for f in ("CommonKVManager._maybe_ack_drained_abort", "DecodeTransferQueue.resolve_deferred_releases")
    }
    | {(v, "DecodePreallocQueue._send_kv_metadata") for v in ("0.5.16", "0.5.17", "0.5.18", "0.5.19", "0.5.20")}
)


def _sources(version: str) -> dict[str, str | None]:
    """The source of every file the map names, under ``sglang/`` of ``version`` (None: no such file)."""
    paths = {entry.partition(":")[0] for entries in mod.SUSPECTS.values() for entry in entries}
    installed = target.resolve("installed")
    if installed.version == version:
        root = Path(installed.root) / "sglang"
        return {p: (root / p).read_text() if (root / p).is_file() else None for p in paths}
    with zipfile.ZipFile(sglang_wheel(version)) as whl:
        names = set(whl.namelist())
        return {p: whl.read(f"sglang/{p}").decode() if f"sglang/{p}" in names else None for p in paths}


@pytest.mark.parametrize("version", SUPPORTED)
def test_every_suspect_is_in_the_release_or_listed_absent(version):
    sources = _sources(version)
    missing = set()
    for entries in mod.SUSPECTS.values():
        for entry in entries:
            path, _, qualname = entry.partition(":")
            assert sources[path] is not None, f"{version} has no sglang/{path}"
            if not mod.defines(sources[path], qualname):
                missing.add((version, qualname))
    expected = {a for a in ABSENT if a[0] == version}
    assert missing == expected, (
        f"{version}: not there {sorted(missing - expected)}; listed absent but there {sorted(expected - missing)}"
    )


def test_a_function_the_target_lacks_is_said_as_not_in_this_release(tmp_path):
    decode = tmp_path / "sglang" / "srt" / "disaggregation" / "decode.py"
    decode.parent.mkdir(parents=True)
    decode.write_text("class DecodePreallocQueue:\n    def _pre_alloc(self):\n        pass\n")
    found = mod.suspects("swa-tail-short", tmp_path)
    assert [str(s) for s in found] == [
        "sglang/srt/disaggregation/decode.py DecodePreallocQueue._swa_tail_len (not in this release)",
        "sglang/srt/disaggregation/decode.py alloc_for_decode_prealloc (not in this release)",
    ]
    assert [str(s) for s in mod.suspects("PreallocError", tmp_path)][
        0
    ] == "sglang/srt/disaggregation/decode.py DecodePreallocQueue._pre_alloc"
    assert mod.suspects("no-such-rule", tmp_path) == []


def test_every_rule_and_knock_on_has_suspects():
    # A rule without suspects would fail without saying where to look; the harness's own bookkeeping
    # rules (its transfer, its probe, its event stream) have no sglang function behind them.
    own = {"transfer-unowned", "probe-unreadable", "no-config", "unknown-kind"}
    unmapped = sorted(set(RULES) - set(mod.SUSPECTS) - own)
    assert unmapped == [], f"rules with no suspect functions: {unmapped}"
    assert set(KNOCK_ONS) <= set(RULES) and all(set(v) <= set(RULES) for v in KNOCK_ONS.values())
