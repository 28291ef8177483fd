"""``harness doctor`` end to end on a local simulated Ray: a healthy cluster passes, and each broken
environment (a topology that does not fit, a port already bound, a probe that hangs, an unsupported
sglang version, wrong or busy GPUs from a fake device source) fails the right check with a fix hint.

The scenarios run in a child process (this file executed as a script) with its own Ray clusters, so
they never meet a Ray session another test of this pytest process holds; the child prints one JSON
report per scenario. The healthy one is ``harness doctor 2-gpu-h100 --simulate --json`` as the
command runs it (its own cluster, started and stopped by the command); the broken ones share one
cluster the child starts. A bounded wait on the child keeps a hang from hanging the test run.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from harness import cli

pytestmark = pytest.mark.est_time(25)

REPO = Path(__file__).resolve().parent.parent
HANG_TIMEOUT_S = 3.0
_CHILD_TIMEOUT_S = 240


def _run_child(args: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    """Run a child; on timeout SIGTERM it (so its Ray cluster is shut down), then SIGKILL."""
    env = {**os.environ, "RAY_DEDUP_LOGS": "0"}
    p = subprocess.Popen(args, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.send_signal(signal.SIGTERM)
        try:
            out, err = p.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
        pytest.fail(f"{args[1:]} did not finish within {timeout:g} s\n{err[-3000:]}")
    return subprocess.CompletedProcess(args, p.returncode, out, err)


@pytest.fixture(scope="module")
def scenarios(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    run_dir = tmp_path_factory.mktemp("doctor")
    done = _run_child([sys.executable, __file__, str(run_dir)], _CHILD_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def _rows(report: dict[str, Any], check: str, status: str | None = None) -> list[dict[str, Any]]:
    return [r for r in report["rows"] if r["check"] == check and (status is None or r["status"] == status)]


def test_healthy_simulated_cluster_passes(scenarios):
    rep = scenarios["healthy"]
    bad = [r for r in rep["rows"] if r["status"] not in ("passed", "simulated")]
    assert rep["exit_code"] == 0 and not bad, bad
    checks = {r["check"] for r in rep["rows"]}
    assert {
        "placement.fit",
        "placement.group",
        "software.sglang_supported",
        "host.disk",
        "host.open_files",
        "host.shm",
        "gpu.model",
        "gpu.processes",
        "network.tcp_rtt",
        "network.transfer",
    } <= checks
    assert all(r["status"] == "simulated" for r in rep["rows"] if r["check"].startswith("gpu."))
    (transfer,) = _rows(rep, "network.transfer")
    assert "mooncake tcp" in transfer["detail"] and "MB/s" in transfer["detail"] and "verified" in transfer["detail"]
    groups = {r["detail"].split(" ")[0]: r["gpu"] for r in _rows(rep, "placement.group")}
    assert groups == {"prefill-0": groups["prefill-0"], "decode-0": groups["decode-0"], "router-0": "-"}
    assert {groups["prefill-0"], groups["decode-0"]} == {"0", "1"}


def test_topology_that_does_not_fit_fails_placement(scenarios):
    rep = scenarios["no_fit"]
    (row,) = _rows(rep, "placement.fit")
    assert rep["exit_code"] == 1 and row["status"] == "failed"
    assert "INFEASIBLE" in row["detail"] and "GPU" in row["detail"] and "8×H200" in row["fix"]
    assert len(rep["rows"]) == 1  # nothing was probed on a cluster the topology does not fit


def test_port_already_bound_is_reported_with_its_holder(scenarios):
    rep = scenarios["port_bound"]
    (row,) = _rows(rep, "network.port")
    assert (
        row["status"] == "failed" and f"pid {rep['holder_pid']}" in row["detail"] and str(rep["port"]) in row["detail"]
    )
    assert row["fix"] and rep["exit_code"] == 1
    assert all(r["status"] in ("passed", "simulated") for r in rep["rows"] if r["check"] != "network.port")


def test_hanging_probe_is_reported_hung_and_not_waited_on(scenarios):
    rep = scenarios["hang"]
    hung = _rows(rep, "software.probe", "hung")
    assert len(hung) == 3 and rep["exit_code"] == 1  # prefill, decode and router probes
    assert all(f"within {HANG_TIMEOUT_S:g} s" in r["detail"] and "py-spy" in r["fix"] for r in hung)
    # The other families answered although every probe has a thread stuck in the versions call.
    assert _rows(rep, "host.disk", "passed") and _rows(rep, "network.transfer", "passed")
    assert rep["wall_s"] < _CHILD_TIMEOUT_S


def test_unsupported_sglang_version_fails(scenarios):
    rep = scenarios["old_sglang"]
    (row,) = _rows(rep, "software.sglang_supported")
    assert row["status"] == "failed" and "0.4.10" in row["detail"] and "--sglang 0.5.N" in row["fix"]


def test_fake_gpus_wrong_model_and_foreign_process_fail(scenarios):
    rep = scenarios["fake_gpus"]
    model = {r["gpu"]: r["status"] for r in _rows(rep, "gpu.model")}
    procs = {r["gpu"]: r for r in _rows(rep, "gpu.processes")}
    assert model == {"0": "failed", "1": "passed"}
    assert procs["0"]["status"] == "passed" and procs["1"]["status"] == "failed"
    assert "pid 4242" in procs["1"]["detail"] and "kill 4242" in procs["1"]["fix"]
    assert _rows(rep, "gpu.count", "passed") and _rows(rep, "gpu.driver", "passed")
    assert not _rows(rep, "gpu.model", "simulated")


def test_cli_doctor_simulate_json(scenarios):
    cli_run = scenarios["cli"]
    assert cli_run["rc"] == 0, cli_run["stdout"][-3000:]
    doc = json.loads(cli_run["stdout"])
    assert doc == scenarios["healthy"]
    assert doc["ok"] and doc["simulated"] and doc["topology"] == "2-gpu-h100"
    assert doc["counts"]["simulated"] > 0 and "failed" not in doc["counts"]


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["doctor", "no-such-topology", "--simulate"], "unknown topology 'no-such-topology'"),
        (["doctor", "cpu", "--simulate", "--port", "70000"], "--port 70000"),
        (["doctor", "cpu", "--simulate", "--timeout", "0"], "--timeout 0"),
        (["doctor", "cpu", "--simulate", "--timeout", "nan"], "--timeout nan: must be a finite number of seconds"),
    ],
)
def test_cli_bad_input_is_one_line_and_exit_2(argv, needle, capsys):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("harness: ") and needle in err and "\n" not in err


def test_cli_simulate_and_ray_address_exclude_each_other(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["doctor", "cpu", "--simulate", "--ray-address", "10.0.0.1:6379"])
    assert e.value.code == 2 and "not allowed with" in capsys.readouterr().err


# ------------------------------------------------------------------------------ the child


def _scenarios(run_dir: Path) -> dict[str, Any]:
    import dataclasses

    from harness import topology
    from harness.cluster import Cluster
    from harness.doctor import Limits, Sources, run
    from harness.doctor.gpu import GpuDevice, GpuProcess, GpuSnapshot, StaticSource
    from harness.doctor.report_text import to_json

    h100 = topology.get("2-gpu-h100")
    out: dict[str, Any] = {}

    def report(name: str, topo: topology.Topology, **kw: Any) -> dict[str, Any]:
        rep = run(topo, cluster=cluster, run_dir=run_dir / name, **{"simulate": True, **kw})
        out[name] = json.loads(to_json(rep))
        return out[name]

    # The command as a user runs it, on a cluster of its own: the healthy report.
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        rc = cli.main(["doctor", "2-gpu-h100", "--simulate", "--json", "--run-dir", str(run_dir / "cli")])
    out["cli"] = {"rc": rc, "stdout": stdout.getvalue()}
    out["healthy"] = json.loads(stdout.getvalue())

    with Cluster.start(h100, simulate=True) as cluster:
        report("no_fit", topology.get("8-gpu-h200"))
        with socket.socket() as s:
            s.bind(("0.0.0.0", 0))
            s.listen()
            port = s.getsockname()[1]
            report("port_bound", h100, ports=(port,))
            out["port_bound"].update(port=port, holder_pid=os.getpid())
        hang = Sources(versions=functools.partial(time.sleep, 3600))
        report("hang", h100, sources=hang, limits=dataclasses.replace(Limits(), check_timeout_s=HANG_TIMEOUT_S))
        old = Sources(versions=functools.partial(dict, python="3.11.7", torch="2.14.1", ray="2.60.0", sglang="0.4.10"))
        report("old_sglang", h100, sources=old)
        snap = GpuSnapshot(
            devices=(
                GpuDevice(0, "GPU-a", "NVIDIA H200", 143771, 143000),
                GpuDevice(1, "GPU-b", "NVIDIA H100 80GB HBM3", 81559, 81000),
            ),
            processes=(GpuProcess(4242, "GPU-b", 300, "python leftover.py"),),
            driver_version="550.54.15",
            cuda_version="12.4",
        )
        report("fake_gpus", h100, simulate=False, sources=Sources(devices=StaticSource(snap)))
    return out


def _main() -> int:
    # SIGTERM from the parent's timeout: unwind so the cluster's shutdown runs.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    print(json.dumps(_scenarios(Path(sys.argv[1]))))
    return 0


if __name__ == "__main__":
    sys.exit(_main())
