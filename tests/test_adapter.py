"""The sglang adapter: no fault applied at import, the rank payload applies them; configuration validation
(targets: tests/test_target.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness.faults import ENV_VAR

pytestmark = pytest.mark.est_time(6)

REPO = Path(__file__).resolve().parent.parent


def _python(code: str, env_extra: dict[str, str], *, pythonpath: Path | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != ENV_VAR}
    env.update(env_extra)
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(pythonpath), str(REPO)])
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def test_importing_the_adapter_applies_no_fault():
    # Faults apply where engine code runs (plugin, rank payload, server sitecustomize), never on import.
    code = (
        "import harness.targets.sglang; from harness import faults; from harness.engines.sim import kvfill; "
        "print(faults.active(), kvfill.pack_pages.__module__)"
    )
    done = _python(code, {ENV_VAR: "corrupt-kv-page"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[] harness.engines.sim.kvfill"


def test_a_rank_payload_applies_the_runs_faults(tmp_path):
    code = (
        "from harness.engines.sim.payload import RankPayload; from harness import faults; "
        "from harness.engines.sim import kvfill; "
        f"RankPayload('r0', 0, 1, {str(tmp_path)!r}, 'prefill'); print(faults.active(), kvfill.pack_pages.__module__)"
    )
    done = _python(code, {ENV_VAR: "corrupt-kv-page"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "['corrupt-kv-page'] harness.faults.sim_faults"


def test_activation_refuses_a_patch_fault_the_imported_sglang_does_not_carry():
    # A source-patch fault lives in a patched copy of sglang (--inject-fault builds it): named in the
    # env while the installed sglang is imported, it must stop the process, not run unbroken.
    done = _python("from harness import faults; faults.activate_from_env()", {ENV_VAR: "swa-tail-unaligned"})
    assert done.returncode != 0
    assert "does not carry them; inject them with --inject-fault" in done.stderr


def test_activation_rejects_unknown_fault_in_env():
    done = _python("from harness import faults; faults.activate_from_env()", {ENV_VAR: "no-such-fault"})
    assert done.returncode != 0
    assert "unknown fault 'no-such-fault'" in done.stderr


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"hisparse": True, "radix_cache": True}, "incompatible"),
        ({"page_size": 32}, "page_size 32"),
        ({"hisparse": True, "page_size": 64}, "page_size 64"),
        ({"window": -1}, "window"),
        ({"device": "tpu"}, "device"),
    ],
)
def test_decode_config_rejects_bad_fields(fields, match):
    from harness.engines.sim import DecodeConfig

    with pytest.raises(ValueError, match=match):
        DecodeConfig(**fields)


def test_pool_sizes_must_be_page_multiples():
    from harness.engines.sim import DecodeConfig, DecodeSide, PoolSizes

    with pytest.raises(ValueError, match="multiple of page_size 256"):
        DecodeSide(DecodeConfig(page_size=256, sizes=PoolSizes(full_tokens=1000)))


def test_decode_side_snapshot_reads_real_pools():
    from harness.engines.sim import DecodeConfig, DecodeSide, make_req

    side = DecodeSide(DecodeConfig(page_size=16, window=40))
    assert side.baseline.free() == {"full": 48 * 256, "swa": 24 * 256, "req_slots": 8}
    req = make_req("r", 100, output_len=3)  # fill = 100 + 2
    result = side.prealloc(req)
    state = side.snapshot([req]).request("r")
    assert (result.fill_len, result.swa_tail_len, state.swa_evicted_seqlen) == (102, 54, 48)
    assert len(state.full_indices) == 102 and state.swa_indices[:48] == (0,) * 48
    side.release(req)
    assert side.snapshot().free() == side.baseline.free()
