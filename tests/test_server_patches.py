"""The server-side modules put on sglang's PYTHONPATH: sgl_kernel shim, import hooks, compat patches, probe.

Server processes are simulated by a plain ``python -c`` subprocess with the launcher's environment,
so what is checked is exactly what a real server gets, without starting one.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from harness import topology
from harness.targets.sglang import selection as target
from harness.engines.server import hooks
from harness.engines.server import patches as compat
from harness.engines.server.launcher import ServerPorts, server_command

pytestmark = pytest.mark.est_time(30)


def run_like_server(code: str, role: str = "decode", **launcher_kwargs) -> subprocess.CompletedProcess:
    cmd = server_command(topology.get("cpu"), role, model="/m", ports=ServerPorts(1, 2, 3), **launcher_kwargs)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], env=cmd.environ(), capture_output=True, text=True, timeout=240
    )


def test_sgl_kernel_shim_imports_and_raises_when_called():
    r = run_like_server(
        """
        import sgl_kernel
        from sgl_kernel.kvcacheio import transfer_kv_all_layer
        from sgl_kernel import fused_add_rmsnorm
        assert sgl_kernel.HARNESS_SHIM
        try:
            transfer_kv_all_layer(1, 2)
        except RuntimeError as e:
            print("raised:", e)
        else:
            raise SystemExit("the shim computed something")
    """,
        compat_patches=(),
    )
    assert r.returncode == 0, r.stderr
    assert "raised: sgl_kernel.kvcacheio.transfer_kv_all_layer was called" in r.stdout


def test_after_import_runs_on_first_import_and_at_once_when_already_imported(tmp_path, monkeypatch):
    (tmp_path / "harness_hook_probe_mod.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []
    hooks.after_import("harness_hook_probe_mod", lambda m: seen.append(m.VALUE))
    assert seen == []
    import harness_hook_probe_mod  # noqa: F401

    assert seen == [1]
    hooks.after_import("harness_hook_probe_mod", lambda m: seen.append(m.VALUE + 1))
    assert seen == [1, 2]


def test_unknown_compat_patch_is_refused_naming_the_known_ones():
    with pytest.raises(compat.CompatError, match="torch-native-swa-read"):
        compat.install(["no-such-patch"])


def test_cpu_server_gets_its_compat_patches_and_the_probe(tmp_path):
    """The sitecustomize applies the named patches and the probe when the real sglang modules load."""
    r = run_like_server(
        """
        import sglang.srt.disaggregation.mooncake.conn as mc
        import sglang.srt.layers.attention.torch_native_backend as tn
        import sglang.srt.mem_cache.common as common
        import sglang.srt.disaggregation.decode as dec
        import sglang.srt.managers.schedule_batch as sb
        assert mc.MooncakeKVSender.supports_host_tensor_indices is False
        assert hasattr(tn.TorchNativeAttnBackend._run_sdpa_forward_decode, "__wrapped__")
        for f in (common.release_kv_cache, dec.alloc_for_decode_prealloc, dec.alloc_for_decode_prealloc_hisparse,
                  sb.ScheduleBatch._evict_swa):
            assert hasattr(f, "__wrapped__"), f
        # Modules that import release_kv_cache by name get the wrapped one too (the hook ran first).
        import sglang.srt.managers.scheduler_components.batch_result_processor as brp
        import sglang.srt.managers.scheduler as sched
        assert hasattr(sched.Scheduler.flush_cache, "__wrapped__")
        assert dec.release_kv_cache is common.release_kv_cache
        assert brp.release_kv_cache is common.release_kv_cache
        # The engine's own start-method call (spawn) leaves fork: its children need no second import.
        import multiprocessing
        import sglang.srt.entrypoints.engine as engine
        engine.mp.set_start_method("spawn", force=True)
        assert multiprocessing.get_start_method() == "fork", multiprocessing.get_start_method()
        print("ok")
    """,
        probe_run_dir=str(tmp_path),
        worker="decode-x",
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "ok" in r.stdout
    assert "compat patch mooncake-host-tensor-indices applied" in r.stderr
    assert "compat patch torch-native-swa-read applied" in r.stderr
    assert "compat patch cpu-fork-children applied" in r.stderr
    assert "accounting probe installed" in r.stderr


def test_unpatched_server_runs_upstream_code(tmp_path):
    r = run_like_server(
        """
        import sglang.srt.disaggregation.mooncake.conn as mc
        import sglang.srt.layers.attention.torch_native_backend as tn
        import sglang.srt.mem_cache.common as common
        assert mc.MooncakeKVSender.supports_host_tensor_indices is True
        assert not hasattr(tn.TorchNativeAttnBackend._run_sdpa_forward_decode, "__wrapped__")
        assert not hasattr(common.release_kv_cache, "__wrapped__")
        import multiprocessing
        import sglang.srt.entrypoints.engine as engine
        engine.mp.set_start_method("spawn", force=True)
        assert multiprocessing.get_start_method() == "spawn"
        print("ok")
    """,
        compat_patches=(),
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "compat patch" not in r.stderr


def test_a_bad_patch_name_stops_the_server_loudly():
    r = run_like_server("print('started')", compat_patches=("no-such-patch",))
    assert r.returncode == 3
    assert "started" not in r.stdout
    assert "unknown compat patch 'no-such-patch'" in r.stderr


def test_probe_records_a_flush_and_the_ledger_sees_what_it_hid(tmp_path):
    """The flush wrapper on real sglang pools: a clean flush balances; pages of a request that was
    never released (a leak sglang's clear() would hide) are a ``reset-leak``."""
    import types

    from harness import ledger
    from harness.engines.sim import DecodeConfig, DecodeSide, make_req
    from harness.engines.server import accounting_probe as probe_mod

    side = DecodeSide(DecodeConfig(page_size=16, window=40))

    def flush(sched):  # what sglang's Scheduler.flush_cache does to the pools of an idle server
        sched.tree_cache.reset()
        sched.req_to_token_pool.clear()
        sched.token_to_kv_pool_allocator.clear()
        return True

    sched = types.SimpleNamespace(
        token_to_kv_pool_allocator=side.allocator, tree_cache=side.tree_cache, req_to_token_pool=side.req_to_token_pool
    )
    path = tmp_path / "server.jsonl"
    wrapped = probe_mod._wrap_flush(probe_mod.Probe(str(path), "server", "decode"), flush)
    req = make_req("r", 100, output_len=3)
    side.prealloc(req)
    side.release(req)
    assert wrapped(sched) is True
    assert [e.kind for e in ledger.read(path)] == ["reset"] and ledger.check(ledger.read(path)) == []
    side.prealloc(make_req("leaked", 100, output_len=3))  # never released
    wrapped(sched)
    found = ledger.check(ledger.read(path))
    assert {v.rule for v in found} == {"reset-leak"} and {"'full'", "'swa'", "'req_slots'"} <= {
        v.message.split()[1].rstrip(":") for v in found
    }


def test_prefill_probe_records_only_flushes(tmp_path):
    r = run_like_server(
        """
        import sglang.srt.mem_cache.common as common
        import sglang.srt.managers.scheduler as sched
        assert hasattr(sched.Scheduler.flush_cache, "__wrapped__")
        assert not hasattr(common.release_kv_cache, "__wrapped__")
        print("ok")
    """,
        role="prefill",
        probe_run_dir=str(tmp_path),
        worker="prefill-x",
        compat_patches=(),
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "ok" in r.stdout


def test_probe_config_comes_from_the_queue_and_an_unreadable_field_is_named(monkeypatch):
    """The probe's config event is the server's configuration (here a real decode queue), and a field it
    cannot read raises with its name instead of turning into a silent None."""
    from harness.engines.sim import DecodeConfig, DecodeSide
    from harness.engines.server import probe_read

    monkeypatch.delenv("SGLANG_SWA_EVICTION_INTERVAL", raising=False)
    side = DecodeSide(DecodeConfig(page_size=64, window=100, radix_cache=True))
    assert probe_read.config_of(side.queue) == side.ledger_config(eviction_interval=128)  # sglang's default interval
    # From 0.5.19 a radix prefix is capped at the window start; before, the tree keeps its SWA.
    from harness.targets.sglang import compat as target_compat

    assert side.ledger_config().prefix_swa_in_tree == (target_compat.missing("decode-radix-swa-prefix") is not None)
    with pytest.raises(probe_read.ProbeReadError, match=r"evicted_seqlen \(req.kv.get_evicted_seqlen"):
        probe_read.evicted_seqlen(object())
    broken = type("Queue", (), {"token_to_kv_pool_allocator": side.allocator, "scheduler": object()})()
    with pytest.raises(probe_read.ProbeReadError, match="scheduler.sliding_window_size"):
        probe_read.config_of(broken)


def test_mooncake_patch_has_nothing_to_do_on_a_release_before_the_host_tensor_path(monkeypatch):
    """0.5.22's Mooncake sender has no pinned-host-tensor path (first in 0.5.23): the CPU patch says it
    is not needed there instead of refusing the server; on 0.5.23 it is applied (test above)."""
    older = target.resolve("0.5.22")  # on first use installed into the targets cache (the trees test runs it too)
    monkeypatch.setenv(target.ENV_VAR, older.spec)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([*older.paths, os.environ.get("PYTHONPATH", "")]))
    r = run_like_server("""
        import sglang.srt.disaggregation.mooncake.conn as mc
        assert not hasattr(mc.MooncakeKVSender, "supports_host_tensor_indices")
        print(mc.__file__)
    """)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().startswith(older.root), r.stdout
    assert "compat patch mooncake-host-tensor-indices not needed" in r.stderr
