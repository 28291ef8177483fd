"""The capability probes and shims that tell 0.5.16 … 0.5.18 from 0.5.19 on agree with every supported
release's own source, and the request-KV view reads and writes each shape's own fields.

Each release's source is read from its wheel, as :mod:`tests.test_suspects` reads it (downloaded once
with ``pip download --no-deps`` into the target cache; the installed release is read in place).
Nothing of an older release is imported: the probes' predicates take source text.
"""

from __future__ import annotations

import ast
import dataclasses
import types
import zipfile
from pathlib import Path

import pytest

from harness.targets.sglang import releases
from harness.targets.sglang import selection as target
from harness.targets.sglang.compat import LegacyReqKv, req_kv
from harness.targets.sglang.compat.capabilities import asserts_floor, keeps_prefix_out_of_tail, reads_status_through_get
from harness.targets.sglang.compat.shims import commits_after_alloc
from wheels import sglang_wheel

pytestmark = pytest.mark.est_time(10)

_, MINOR, OLDEST = releases.OLDEST_RELEASE
SUPPORTED = tuple(f"0.{MINOR}.{n}" for n in range(OLDEST, releases.NEWEST_CHECKED[2] + 1))
#: The first release with sglang's evict-floor asserts (#35286 / #35396), the radix prefix kept out of
#: the SWA tail, and alloc_for_decode committing the new token itself.
FIRST_WITH_ASSERTS = "0.5.19"
#: The first release whose CommonKVManager.update_status reads the room once, with request_status.get.
FIRST_READING_STATUS_WITH_GET = "0.5.20"


def _release(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in version.split("."))


def _source(version: str, rel: str) -> str:
    """``sglang/<rel>`` of ``version``: the installed tree's when it is that release, else its wheel's."""
    installed = target.resolve("installed")
    if installed.version == version:
        return (Path(installed.root) / "sglang" / rel).read_text()
    with zipfile.ZipFile(sglang_wheel(version)) as whl:
        return whl.read(f"sglang/{rel}").decode()


def _function(source: str, qualname: str) -> str:
    """The source text of ``func`` or ``Class.method`` in a module's source (read with :mod:`ast`)."""
    module = ast.parse(source)
    scope: list[ast.stmt] = module.body
    *owners, name = qualname.split(".")
    for owner in owners:
        scope = next(n for n in scope if isinstance(n, ast.ClassDef) and n.name == owner).body
    node = next(n for n in scope if isinstance(n, ast.FunctionDef) and n.name == name)
    return ast.get_source_segment(source, node) or ""


@pytest.mark.parametrize("version", SUPPORTED)
def test_probes_split_the_releases_where_the_asserts_came(version):
    newer = _release(version) >= _release(FIRST_WITH_ASSERTS)
    decode = _source(version, "srt/disaggregation/decode.py")
    for prealloc in ("alloc_for_decode_prealloc", "alloc_for_decode_prealloc_hisparse"):
        assert asserts_floor(_function(decode, prealloc)) is newer, f"{version} {prealloc}"
    assert keeps_prefix_out_of_tail(_function(decode, "DecodePreallocQueue.pop_preallocated")) is newer, version
    batch = _source(version, "srt/managers/schedule_batch.py")
    assert commits_after_alloc(_function(batch, "ScheduleBatch.prepare_for_decode")) is not newer, version


@pytest.mark.parametrize("version", SUPPORTED)
def test_the_status_read_probe_splits_the_releases_where_update_status_changed(version):
    conn = _source(version, "srt/disaggregation/common/conn.py")
    update = _function(conn, "CommonKVManager.update_status")
    assert reads_status_through_get(update) is (_release(version) >= _release(FIRST_READING_STATUS_WITH_GET)), version


def test_probes_say_no_for_code_without_the_change():
    assert asserts_floor("    assert (\n        swa_evicted_seqlen >= 0\n        and x % p == 0\n    )\n")
    assert not asserts_floor("    req.kv.swa_evicted_seqlen = fill_len - swa_tail_len\n")
    assert not keeps_prefix_out_of_tail("prefix_match = self._match_prefix_and_lock(req)\n")
    assert not commits_after_alloc("for req in self.reqs:\n    req.decode_batch_idx += 1\n")


@dataclasses.dataclass
class _TwoFieldKv:  # 0.5.16 … 0.5.18's ReqKvInfo, field for field
    kv_allocated_len: int
    swa_evicted_seqlen: int


def test_the_request_kv_view_uses_each_shape_s_own_fields():
    # 0.5.16 … 0.5.18: slot, committed length and protected prefix on the request; lengths on req.kv.
    req = types.SimpleNamespace(kv=_TwoFieldKv(320, 256), req_pool_idx=3, kv_committed_len=300, cache_protected_len=0)
    kv = req_kv(req)
    assert isinstance(kv, LegacyReqKv)
    assert (kv.req_pool_idx, kv.kv_committed_len, kv.kv_allocated_len, kv.swa_evicted_seqlen) == (3, 300, 320, 256)
    kv.kv_committed_len, kv.kv_allocated_len, kv.cache_protected_len = 301, 384, 64
    assert (req.kv_committed_len, req.kv.kv_allocated_len, req.cache_protected_len) == (301, 384, 64)
    assert kv.holds_kv
    kv.mark_kv_released()
    assert req.kv is None and kv.kv_allocated_len == 0 and kv.swa_evicted_seqlen == 0  # release_kv_cache's shape
    # 0.5.19 on: req.kv owns all of it and is returned as it is.
    owner = types.SimpleNamespace(req_pool_idx=None, kv_committed_len=0, kv_allocated_len=0)
    assert req_kv(types.SimpleNamespace(kv=owner)) is owner
