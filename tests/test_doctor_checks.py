"""The doctor's check families as pure functions: each check's pass and fail path, GPU checks over a
fake device-properties source (a hand-built snapshot), never a GPU."""

from __future__ import annotations

import importlib.metadata
import json
import os
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from harness import topology
from harness.doctor import gpu, host, network, placement_check, render, software
from harness.doctor.probe import Probe, Sources, Target
from harness.doctor.result import CheckResult, Limits, Report, Status

H100 = topology.get("2-gpu-h100")
H200x8 = topology.get("8-gpu-h200")
LIMITS = Limits()
NODE = "node0/10.0.0.1"


def _by(rows: list[CheckResult], check: str) -> list[CheckResult]:
    found = [r for r in rows if r.check == check]
    assert found, f"no {check} row in {[r.check for r in rows]}"
    return found


def _one(rows: list[CheckResult], check: str) -> CheckResult:
    (row,) = _by(rows, check)
    return row


# ------------------------------------------------------------------------------ GPU


def _dev(i: int, name: str = "NVIDIA H100 80GB HBM3", total: int = 81559, free: int = 81000) -> gpu.GpuDevice:
    return gpu.GpuDevice(i, f"GPU-{i:04d}", name, total, free)


def _snap(
    *devices: gpu.GpuDevice,
    procs: tuple[gpu.GpuProcess, ...] | None = (),
    driver: str = "550.54.15",
    cuda: str = "12.4",
) -> gpu.GpuSnapshot:
    return gpu.StaticSource(gpu.GpuSnapshot(devices, procs, driver, cuda, "fake")).snapshot()


def test_gpu_checks_pass_on_matching_free_devices():
    rows = gpu.check_node(H100, NODE, _snap(_dev(0), _dev(1))) + gpu.check_bundle(
        H100, NODE, ["1"], _snap(_dev(0), _dev(1)), LIMITS
    )
    assert [r.check for r in rows] == ["gpu.count", "gpu.model", "gpu.memory", "gpu.free_memory", "gpu.processes"]
    assert all(r.status is Status.PASSED for r in rows), rows
    assert all(r.gpu == "1" for r in rows[1:])


def test_gpu_model_mismatch_fails_with_fix():
    row = _one(
        gpu.check_bundle(H100, NODE, ["0"], _snap(_dev(0, name="NVIDIA H200", total=143771)), LIMITS), "gpu.model"
    )
    assert row.status is Status.FAILED
    assert "NVIDIA H200" in row.detail and "H100" in row.detail
    assert "H100" in row.fix


def test_gpu_memory_size_mismatch_fails():
    row = _one(
        gpu.check_bundle(H100, NODE, ["0"], _snap(_dev(0, name="NVIDIA H100 NVL", total=95830, free=95000)), LIMITS),
        "gpu.memory",
    )
    assert row.status is Status.FAILED and "93.6 GiB" in row.detail and row.fix


def test_gpu_low_free_memory_fails():
    row = _one(gpu.check_bundle(H100, NODE, ["0"], _snap(_dev(0, free=20000)), LIMITS), "gpu.free_memory")
    assert row.status is Status.FAILED and "25%" in row.detail and row.fix


def test_gpu_foreign_process_is_listed_with_pid_and_command():
    snap = _snap(
        _dev(0),
        _dev(1),
        procs=(
            gpu.GpuProcess(4242, "GPU-0000", 30000, "python -m sglang.launch_server"),
            gpu.GpuProcess(77, "GPU-0001", 500, "other"),
        ),
    )
    row = _one(gpu.check_bundle(H100, NODE, ["0"], snap, LIMITS), "gpu.processes")
    assert row.status is Status.FAILED
    assert "pid 4242" in row.detail and "sglang.launch_server" in row.detail and "pid 77" not in row.detail
    assert "kill 4242" in row.fix


def test_gpu_own_processes_are_not_foreign():
    snap = _snap(_dev(0), procs=(gpu.GpuProcess(4242, "GPU-0000", 300, "probe"),))
    row = _one(gpu.check_bundle(H100, NODE, ["0"], snap, LIMITS, own_pids=frozenset({4242})), "gpu.processes")
    assert row.status is Status.PASSED


def test_gpu_process_list_unavailable_fails():
    row = _one(gpu.check_bundle(H100, NODE, ["0"], _snap(_dev(0), procs=None), LIMITS), "gpu.processes")
    assert row.status is Status.FAILED and "nvidia-smi" in row.fix


def test_gpu_count_short_fails():
    snap = _snap(*(_dev(i, "NVIDIA H200", 143771, 143000) for i in range(7)))
    row = _one(gpu.check_node(H200x8, NODE, snap), "gpu.count")
    assert row.status is Status.FAILED and "only 7" in row.detail and row.fix


def test_gpu_id_unknown_to_the_node_fails_every_gpu_row():
    rows = gpu.check_bundle(H100, NODE, ["5"], _snap(_dev(0), _dev(1)), LIMITS)
    assert len(rows) == 4 and all(r.status is Status.FAILED and "GPU 5" in r.detail for r in rows)


def test_gpu_uuid_ids_are_matched():
    rows = gpu.check_bundle(H100, NODE, ["GPU-0001"], _snap(_dev(0), _dev(1)), LIMITS)
    assert all(r.status is Status.PASSED for r in rows)


def test_gpu_query_error_fails_with_fix():
    snap = gpu.GpuSnapshot(source="nvidia-smi", error="nvidia-smi did not answer within 10 s")
    rows = gpu.check_node(H100, NODE, snap) + gpu.check_bundle(H100, NODE, ["0"], snap, LIMITS)
    assert all(r.status is Status.FAILED and "did not answer" in r.detail and "nvidia-smi" in r.fix for r in rows)


def test_gpu_driver_versions_equal_and_differing():
    same = gpu.check_versions_equal({"a": _snap(_dev(0)), "b": _snap(_dev(0))})
    assert _one(same, "gpu.driver").status is Status.PASSED
    diff = _one(
        gpu.check_versions_equal({"a": _snap(_dev(0)), "b": _snap(_dev(0), driver="535.1", cuda="12.2")}), "gpu.driver"
    )
    assert diff.status is Status.FAILED and "535.1" in diff.detail and "550.54.15" in diff.detail and diff.fix


def test_gpu_simulated_rows_say_simulated_not_passed():
    rows = gpu.simulated_rows(NODE, ["2", "3"])
    assert rows and all(r.status is Status.SIMULATED for r in rows)
    assert Report("t", True, tuple(rows)).ok


_SMI = """#!/bin/sh
case "$1" in
  --query-gpu=*) echo "0, GPU-aaaa, NVIDIA H100 80GB HBM3, 81559, 1000, 550.54.15"
                 echo "1, GPU-bbbb, NVIDIA H100 80GB HBM3, 81559, 81000, 550.54.15" ;;
  --query-compute-apps=*) echo "999999, GPU-aaaa, 80000, /usr/bin/python3" ;;
  *) echo "| NVIDIA-SMI 550.54.15   Driver Version: 550.54.15   CUDA Version: 12.4 |" ;;
esac
"""


def _script(path: Path, text: str) -> str:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def test_nvidia_smi_source_parses_the_real_output_shape(tmp_path: Path):
    snap = gpu.NvidiaSmiSource(binary=_script(tmp_path / "nvidia-smi", _SMI)).snapshot()
    assert snap.error is None
    assert [d.uuid for d in snap.devices] == ["GPU-aaaa", "GPU-bbbb"]
    assert snap.driver_version == "550.54.15" and snap.cuda_version == "12.4"
    assert snap.processes == (gpu.GpuProcess(999999, "GPU-aaaa", 80000, "/usr/bin/python3"),)
    rows = gpu.check_bundle(H100, NODE, ["0"], snap, LIMITS)
    assert {r.check for r in rows if r.status is Status.FAILED} == {"gpu.free_memory", "gpu.processes"}


def test_nvidia_smi_source_that_hangs_is_an_error_not_a_hang(tmp_path: Path):
    smi = _script(tmp_path / "nvidia-smi", "#!/bin/sh\nexec sleep 30\n")
    snap = gpu.NvidiaSmiSource(binary=smi, timeout_s=0.5).snapshot()
    assert snap.error and "did not answer" in snap.error


def test_nvidia_smi_missing_is_an_error(tmp_path: Path):
    snap = gpu.NvidiaSmiSource(binary=str(tmp_path / "absent")).snapshot()
    assert snap.error and "nvidia-smi failed" in snap.error


# ------------------------------------------------------------------------------ software

GOOD = {"python": "3.11.7", "torch": "2.14.1", "ray": "2.60.0", "sglang": "0.5.23", "mooncake": "0.3.13.post1"}


def test_software_identical_and_supported_passes():
    rows = software.check_versions({"a": dict(GOOD), "b": dict(GOOD)})
    assert all(r.status is Status.PASSED for r in rows), rows
    assert {r.check for r in rows} >= {
        "software.python",
        "software.torch",
        "software.ray",
        "software.sglang",
        "software.sglang_supported",
    }


def test_software_version_mismatch_across_nodes_fails():
    rows = software.check_versions({"node0/a": dict(GOOD), "node1/b": {**GOOD, "torch": "2.13.0"}})
    row = _one(rows, "software.torch")
    assert row.status is Status.FAILED
    assert "node0/a: 2.14.1" in row.detail and "node1/b: 2.13.0" in row.detail and row.fix
    assert _one(rows, "software.ray").status is Status.PASSED


def test_software_unsupported_sglang_fails_even_when_identical():
    rows = software.check_versions({"a": {**GOOD, "sglang": "0.4.10"}})
    assert _one(rows, "software.sglang").status is Status.PASSED
    row = _one(rows, "software.sglang_supported")
    assert row.status is Status.FAILED and "0.4.10" in row.detail and "0.5.16 … 0.5.23" in row.detail
    assert "--sglang" in row.fix


def test_software_sglang_in_the_adapters_range_passes():
    row = _one(software.check_versions({"a": {**GOOD, "sglang": "0.5.20"}}), "software.sglang_supported")
    assert row.status is Status.PASSED and "0.5.20" in row.detail


def test_software_missing_required_package_fails():
    rows = software.check_versions({"a": {**GOOD, "ray": None}})
    assert _one(rows, "software.ray").status is Status.FAILED


def test_doctor_imports_no_sglang_and_reads_the_adapters_range():
    # Doctor reports a broken or unsupported sglang, so it must not import it to learn the range.
    code = (
        "import sys, harness.doctor, harness.commands.doctor; "
        "print(sorted(m for m in sys.modules if m == 'sglang' or m.startswith('sglang.')))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip() == "[]"
    from harness.targets.sglang import compat

    assert software.SUPPORTED_RANGE == compat.SUPPORTED_RANGE


def test_installed_versions_reads_metadata_through_the_seam():
    known = {"torch": "9.9", "ray": "2.60.0", "sglang": "0.5.23", "mooncake-transfer-engine-non-cuda": "0.3.13.post1"}

    def version_of(name: str) -> str:
        if name not in known:
            raise importlib.metadata.PackageNotFoundError(name)
        return known[name]

    v = software.installed_versions(version_of)
    assert v["torch"] == "9.9" and v["mooncake"] == "0.3.13.post1 (mooncake-transfer-engine-non-cuda)"
    assert v["python"].count(".") == 2


# ------------------------------------------------------------------------------ host


def _facts(**kw) -> host.HostFacts:
    base = dict(run_dir="/runs", disk_free_bytes=100 << 30, nofile_soft=1024, nofile_hard=65536, shm_bytes=16 << 30)
    return host.HostFacts(**{**base, **kw})


def test_host_checks_pass():
    rows = host.check_host(NODE, _facts(), LIMITS)
    assert [r.check for r in rows] == ["host.disk", "host.open_files", "host.shm"]
    assert all(r.status is Status.PASSED for r in rows)


@pytest.mark.parametrize(
    "field,value,check",
    [
        ("disk_free_bytes", 2 << 30, "host.disk"),
        ("nofile_hard", 4096, "host.open_files"),
        ("shm_bytes", 64 << 20, "host.shm"),
        ("shm_bytes", None, "host.shm"),
    ],
)
def test_host_check_fails_with_fix(field: str, value, check: str):
    kw = {field: value, **({"nofile_soft": 1024} if field == "nofile_hard" else {})}
    row = _one(host.check_host(NODE, _facts(**kw), LIMITS), check)
    assert row.status is Status.FAILED and row.fix


def test_host_facts_measure_the_nearest_existing_parent(tmp_path: Path):
    facts = host.host_facts(tmp_path / "not" / "yet")
    assert facts.run_dir == str(tmp_path.resolve())
    assert facts.disk_free_bytes > 0 and facts.nofile_soft > 0


# ------------------------------------------------------------------------------ network


def test_listener_round_trip_and_bulk_on_loopback():
    lis = network.Listener("127.0.0.1")
    try:
        assert lis.port > 0
        rt = network.round_trip(lis.host, lis.port, pings=3)
        assert rt.pings == 3 and 0 < rt.min_ms <= rt.median_ms
        assert network.bulk_send(lis.host, lis.port, 3 << 20) > 0
    finally:
        lis.close()


def test_round_trip_to_a_closed_port_raises():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: connections are refused
        with pytest.raises(OSError):
            network.round_trip("127.0.0.1", port, pings=1, timeout_s=2)


def test_port_holder_names_the_process_holding_a_bound_port():
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        s.listen()
        port = s.getsockname()[1]
        holder = network.port_holder(port)
        assert holder is not None and f"pid {os.getpid()}" in holder
        row = network.check_port(NODE, "prefill", port, holder)
    assert row.status is Status.FAILED and str(port) in row.detail and "engine_args" in row.fix


def test_port_holder_free_port():
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        port = s.getsockname()[1]
    assert network.port_holder(port) is None
    assert network.check_port(NODE, "decode", port, None).status is Status.PASSED


def test_fixed_ports_from_engine_args():
    topo = topology.parse(
        {
            "name": "t",
            "runner": "r",
            "cluster": {"nodes": 1, "gpus_per_node": 0},
            "roles": {
                "prefill": {
                    "gpus_per_rank": 0,
                    "engine_args": ["--port", "30000", "--disaggregation-bootstrap-port=8998"],
                },
                "decode": {"gpus_per_rank": 0, "engine_args": ["--mem-fraction-static", "0.8"]},
            },
        },
        "t.toml",
    )
    assert network.fixed_ports(topo) == {"prefill": (30000, 8998)}


def _pair(**kw) -> network.PairResult:
    base = dict(
        src="prefill-0.r0",
        dst="decode-0.r0",
        src_node="n0",
        dst_node="n1",
        rtt=network.RoundTrip(0.1, 0.2, 5),
        tcp_bulk_s=0.01,
        transfer_s=0.02,
        transfer_protocol="tcp",
        verified=True,
        sent_digest="x",
    )
    return network.PairResult(**{**base, **kw})


def test_pair_passes_with_mooncake_transfer_and_bandwidth():
    rows = network.check_pair(_pair(), "mooncake", 4 << 20)
    assert [r.status for r in rows] == [Status.PASSED, Status.PASSED]
    assert "mooncake tcp" in rows[1].detail and "MB/s" in rows[1].detail and rows[1].node == "n0→n1"


def test_pair_without_mooncake_fails_with_install_hint_and_labels_the_tcp_fallback():
    row = _one(
        network.check_pair(
            _pair(mooncake_missing="ImportError: no module mooncake", transfer_s=None), "mooncake", 4 << 20
        ),
        "network.transfer",
    )
    assert row.status is Status.FAILED
    assert "mooncake-transfer-engine" in row.fix and "plain TCP socket bulk transfer" in row.detail


@pytest.mark.parametrize(
    "kw",
    [
        dict(verified=False),
        dict(verified=None),
        dict(transfer_s=None, transfer_error="transfer_sync_write returned -1"),
    ],
)
def test_pair_transfer_failure_or_corruption_fails(kw):
    row = _one(network.check_pair(_pair(**kw), "mooncake", 4 << 20), "network.transfer")
    assert row.status is Status.FAILED and row.fix


def test_pair_rtt_failure_fails():
    row = _one(
        network.check_pair(_pair(rtt=None, rtt_error="TCP to 10.0.0.2:4000 failed: refused"), "mooncake", 1 << 20),
        "network.tcp_rtt",
    )
    assert row.status is Status.FAILED and "refused" in row.detail and "firewall" in row.fix


def test_pair_other_backend_uses_labelled_tcp_bulk():
    row = _one(network.check_pair(_pair(transfer_s=None), "nixl", 4 << 20), "network.transfer")
    assert (
        row.status is Status.PASSED
        and "plain TCP socket bulk transfer" in row.detail
        and "no nixl self-test" in row.detail
    )


def test_probe_without_mooncake_fails_the_transfer_and_labels_the_tcp_fallback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    # A probe built in-process (no Ray, no log redirection) on a node where mooncake is missing.
    monkeypatch.setitem(sys.modules, "mooncake.engine", None)  # the next import raises ImportError
    monkeypatch.setenv("MC_FORCE_TCP", "1")  # the endpoint sets it before importing; restored after
    probe = Probe("prefill-0.r0", True, str(tmp_path), Sources())
    assert probe.mooncake_target(["prefill-0.r0"], 1 << 20)["missing"].startswith("ImportError")
    lis = network.Listener("127.0.0.1")
    try:
        (pair,) = probe.measure(
            "n0", "0", [Target("decode-0.r0", "n0", "1", lis.host, lis.port)], 1 << 20, 2, mooncake=True
        )
    finally:
        lis.close()
    assert pair.rtt is not None and pair.tcp_bulk_s is not None and pair.mooncake_missing
    rtt, transfer = network.check_pair(pair, "mooncake", 1 << 20)
    assert rtt.status is Status.PASSED and rtt.gpu == "0→1"
    assert (
        transfer.status is Status.FAILED
        and "plain TCP socket bulk transfer (not the transfer backend)" in transfer.detail
    )
    assert transfer.fix == network.MOONCAKE_INSTALL_HINT


def test_mooncake_endpoints_transfer_and_verify(monkeypatch: pytest.MonkeyPatch):
    try:
        import mooncake.engine  # noqa: F401
    except ImportError as e:
        pytest.skip(f"mooncake transfer engine not installed: {e}")
    monkeypatch.setenv("MOONCAKE_PROTOCOL", "tcp")
    monkeypatch.setenv("MC_FORCE_TCP", "1")
    recv, send = network.MooncakeEndpoint("127.0.0.1", True), network.MooncakeEndpoint("127.0.0.1", True)
    try:
        addr = recv.buffer("recv-a", 1 << 20)
        seconds, digest = send.write(recv.session_id, addr, 1 << 20, b"seed")
        assert seconds > 0 and recv.digest("recv-a") == digest
        assert recv.protocol == "tcp"
    finally:
        send.close()
        recv.close()


# ------------------------------------------------------------------------------ placement


def _seat(group: str, rank: int, node: str, gpus: tuple[str, ...], index: int | None = 0, role: str | None = None):
    return placement_check.BundleSeat(role or group.split("-")[0], group, rank, node, index, gpus)


def test_placement_seats_pass():
    rows = placement_check.seat_rows(
        H100, [_seat("prefill-0", 0, NODE, ("0",)), _seat("decode-0", 0, NODE, ("1",)), _seat("router-0", 0, NODE, ())]
    )
    assert len(rows) == 3 and all(r.status is Status.PASSED for r in rows)
    assert rows[0].gpu == "0" and "prefill-0" in rows[0].detail


def test_placement_split_tp_group_and_wrong_gpu_count_fail():
    rows = placement_check.seat_rows(
        H200x8, [_seat("prefill-0", 0, "n0", ("0",)), _seat("prefill-0", 1, "n1", ("0", "1"))]
    )
    row = _one(rows, "placement.group")
    assert row.status is Status.FAILED and "split across nodes" in row.detail and "GPU count" in row.detail and row.fix


def test_placement_pinned_role_elsewhere_fails():
    two = topology.get("2-node-16-gpu-h200")
    seats = [_seat("decode-0", r, "node0/x", (str(r),), index=0) for r in range(8)]
    row = _one(placement_check.seat_rows(two, seats), "placement.group")
    assert row.status is Status.FAILED and "pinned to node 1" in row.detail


def test_fit_rows():
    ok = placement_check.fit_row(H100, True, "CREATED", "", "", "a local Ray")
    assert ok.status is Status.PASSED
    bad = placement_check.fit_row(
        H200x8, False, "INFEASIBLE", "prefill-0", "GPU: needs 4 on one node, the largest node has 2", "x"
    )
    assert bad.status is Status.FAILED and "GPU: needs 4" in bad.detail and "8×H200" in bad.fix
    busy = placement_check.fit_row(H100, False, "NO_RESOURCES", "decode-0", "GPU: ...", "x")
    assert "ray status" in busy.fix
    assert placement_check.simulation_refused_row(H100).status is Status.FAILED


# ------------------------------------------------------------------------------ result and render


def test_a_failing_row_needs_a_fix_hint():
    with pytest.raises(ValueError, match="fix"):
        CheckResult("x.y", Status.FAILED, "broken")
    with pytest.raises(ValueError):
        CheckResult("x.y", Status.HUNG, "stuck")
    CheckResult("x.y", Status.PASSED, "fine")


def test_report_exit_code_and_rendering():
    ok_rows = (
        CheckResult("a.b", Status.PASSED, "fine"),
        CheckResult("gpu.model", Status.SIMULATED, "logical", gpu="0"),
    )
    assert Report("t", True, ok_rows).exit_code == 0
    assert Report("t", True, ()).exit_code == 1  # nothing checked is not a pass
    bad = Report(
        "t",
        False,
        ok_rows + (CheckResult("host.shm", Status.FAILED, "/dev/shm 0.1 GiB", "enlarge it", node="n0"),),
        1.5,
    )
    assert bad.exit_code == 1 and bad.counts() == {"passed": 1, "simulated": 1, "failed": 1}
    text = render.table(bad)
    assert "host.shm" in text and "how to fix: enlarge it" in text and text.rstrip().endswith("in 1.5 s")
    assert "NOT OK" in text
    doc = json.loads(render.to_json(bad))
    assert doc["exit_code"] == 1 and doc["rows"][2] == {
        "check": "host.shm",
        "status": "failed",
        "detail": "/dev/shm 0.1 GiB",
        "fix": "enlarge it",
        "node": "n0",
        "gpu": "-",
    }
    assert "simulated rows count as passed" in render.verdict(Report("t", True, ok_rows))
