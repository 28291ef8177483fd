"""The launcher's command line for every role of every shipped topology, exactly (pure and fast)."""

from __future__ import annotations

import os

import pytest

from harness import topology
from harness.targets.sglang.compat import checks
from harness.engines.server import launcher
from harness.engines.server.launcher import (
    CPU_SHIM_DIR,
    SITE_DIR,
    LaunchError,
    ServerPorts,
    plain_server_command,
    router_command,
    server_command,
)

PY = "/venv/bin/python"
MODEL = "/models/m"
#: sglang's own checks, on in every server (harness/targets/sglang/compat/checks.py).
CHECKS_ENV = checks.environment(None)
PREFILL_PORTS = ServerPorts(http=30001, nccl=30002, bootstrap=30003)
DECODE_PORTS = ServerPorts(http=30011, nccl=30012)

CPU_FLAGS = [
    "--device",
    "cpu",
    "--attention-backend",
    "torch_native",
    "--disable-cuda-graph",
    "--max-total-tokens",
    "8192",
    "--page-size",
    "64",
    "--random-seed",
    "0",
    "--sleep-on-idle",
]
CPU_ENV = {
    "SGLANG_USE_CPU_ENGINE": "1",
    "HF_HUB_OFFLINE": "1",
    "SGLANG_HOST_IP": "127.0.0.1",
    "MOONCAKE_PROTOCOL": "tcp",
    "MC_FORCE_TCP": "1",
    "SGLANG_PYSPY_DUMP_BEFORE_CRASH": "0",
    "SGLANG_CUDA_COREDUMP_BEFORE_CRASH": "0",
    "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": "1",
    "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT": "5",
    "SGLANG_EXTERNAL_MODEL_PACKAGE": "harness_tiny_models",
    "HARNESS_COMPAT_PATCHES": (
        "mooncake-host-tensor-indices,torch-native-swa-read,cpu-fork-children,cpu-tp-without-pynccl"
    ),
}


def head(ports: ServerPorts) -> list[str]:
    return [
        PY,
        "-m",
        "sglang.launch_server",
        "--model-path",
        MODEL,
        "--host",
        "127.0.0.1",
        "--port",
        str(ports.http),
        "--nccl-port",
        str(ports.nccl),
    ]


def prefill_mode(backend: str = "mooncake") -> list[str]:
    return [
        "--disaggregation-mode",
        "prefill",
        "--disaggregation-transfer-backend",
        backend,
        "--disaggregation-bootstrap-port",
        "30003",
    ]


def decode_mode(backend: str = "mooncake") -> list[str]:
    return ["--disaggregation-mode", "decode", "--disaggregation-transfer-backend", backend]


# ------------------------------------------------------------------ cpu


def test_cpu_prefill_exact():
    cmd = server_command(topology.get("cpu"), "prefill", model=MODEL, ports=PREFILL_PORTS, python=PY)
    assert list(cmd.argv) == [
        *head(PREFILL_PORTS),
        "--tp",
        "1",
        *prefill_mode(),
        *CPU_FLAGS,
        "--disable-overlap-schedule",
    ]
    assert dict(cmd.env) == {**CPU_ENV, **CHECKS_ENV}
    assert cmd.pythonpath == (str(SITE_DIR), str(CPU_SHIM_DIR))
    assert cmd.role == "prefill"


def test_cpu_decode_exact():
    cmd = server_command(topology.get("cpu"), "decode", model=MODEL, ports=DECODE_PORTS, python=PY)
    assert list(cmd.argv) == [
        *head(DECODE_PORTS),
        "--tp",
        "1",
        *decode_mode(),
        *CPU_FLAGS,
        "--disaggregation-decode-retraction-backup",
        "cpu_tensor",
    ]
    assert dict(cmd.env) == {**CPU_ENV, **CHECKS_ENV}
    assert cmd.pythonpath == (str(SITE_DIR), str(CPU_SHIM_DIR))


def test_cpu_router_exact():
    cmd = router_command(
        topology.get("cpu"),
        prefill=[("http://127.0.0.1:30001", 30003)],
        decode=["http://127.0.0.1:30011"],
        port=30021,
        prometheus_port=30022,
        python=PY,
    )
    assert list(cmd.argv) == [
        PY,
        "-m",
        "harness.engines.server.router",
        "--host",
        "127.0.0.1",
        "--port",
        "30021",
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        "30022",
        "--pd-disaggregation",
        "--policy",
        "round_robin",
        "--prefill",
        "http://127.0.0.1:30001",
        "30003",
        "--decode",
        "http://127.0.0.1:30011",
    ]
    assert dict(cmd.env) == {} and cmd.pythonpath == ()


def test_cpu_router_mini_lb_is_pd_with_random_policy():
    cmd = router_command(
        topology.get("cpu"),
        prefill=[("http://a:1", None)],
        decode=["http://b:2"],
        port=3,
        prometheus_port=4,
        python=PY,
        mini_lb=True,
    )
    assert list(cmd.argv) == [
        PY,
        "-m",
        "harness.engines.server.router",
        "--host",
        "127.0.0.1",
        "--port",
        "3",
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        "4",
        "--pd-disaggregation",
        "--policy",
        "random",
        "--mini-lb",
        "--prefill",
        "http://a:1",
        "none",
        "--decode",
        "http://b:2",
    ]


def test_cpu_plain_server_is_decode_shape_without_disaggregation():
    ports = ServerPorts(http=1, nccl=2)
    cmd = plain_server_command(topology.get("cpu"), model=MODEL, ports=ports, python=PY)
    assert list(cmd.argv) == [*head(ports), "--tp", "1", *CPU_FLAGS]
    assert dict(cmd.env) == {**CPU_ENV, **CHECKS_ENV}


def test_a_cpu_server_of_tp_2_binds_each_rank_to_a_core_and_tp_1_binds_none(monkeypatch):
    # sglang refuses a CPU server of TP > 1 without per-rank cores when the machine has fewer NUMA nodes
    # than ranks; ranks past the cores share them in turn.
    hetero = topology.get("cpu-tp1-tp2")
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    decode = server_command(hetero, "decode", model=MODEL, ports=DECODE_PORTS, python=PY)
    prefill = server_command(hetero, "prefill", model=MODEL, ports=PREFILL_PORTS, python=PY)
    assert decode.argv[decode.argv.index("--tp") + 1] == "2" and decode.env["SGLANG_CPU_OMP_THREADS_BIND"] == "0|1"
    assert prefill.argv[prefill.argv.index("--tp") + 1] == "1" and "SGLANG_CPU_OMP_THREADS_BIND" not in prefill.env
    assert "cpu-tp-without-pynccl" in decode.env["HARNESS_COMPAT_PATCHES"].split(",")
    monkeypatch.setattr(os, "cpu_count", lambda: 1)
    again = server_command(hetero, "decode", model=MODEL, ports=DECODE_PORTS, python=PY)
    assert again.env["SGLANG_CPU_OMP_THREADS_BIND"] == "0|0"


def test_cpu_compat_patches_and_probe_env():
    cmd = server_command(
        topology.get("cpu"),
        "decode",
        model=MODEL,
        ports=DECODE_PORTS,
        python=PY,
        compat_patches=(),
        probe_run_dir="/runs/r",
        worker="decode-2",
    )
    assert "HARNESS_COMPAT_PATCHES" not in cmd.env
    assert cmd.env["HARNESS_PROBE_LEDGER"] == "/runs/r/ledger/decode-2.jsonl"
    assert cmd.env["HARNESS_PROBE_WORKER"] == "decode-2"
    assert cmd.env["HARNESS_PROBE_COMPONENT"] == "decode"
    assert cmd.role == "decode-2"
    assert "HARNESS_KV_HEADS" not in cmd.env  # equal TP: rank 0's ledger digests say it all


def test_unequal_tp_servers_record_every_ranks_heads_and_only_with_the_probe():
    hetero = topology.get("cpu-tp1-tp2")
    for role in ("prefill", "decode"):
        ports = DECODE_PORTS if role == "decode" else PREFILL_PORTS
        cmd = server_command(hetero, role, model=MODEL, ports=ports, python=PY, probe_run_dir="/runs/r")
        assert cmd.env["HARNESS_KV_HEADS"] == "/runs/r/kv_heads", role
    bare = server_command(hetero, "decode", model=MODEL, ports=DECODE_PORTS, python=PY)
    assert "HARNESS_KV_HEADS" not in bare.env


def test_extra_env_is_set_last_and_only_on_its_server():
    # sglang knobs only an env var sets (the decode's transfer timeout): the caller's value wins over
    # the CPU recipe's, and a stack hands it to the role it names only (stack.pd_commands).
    from harness.engines.server.stack import pd_commands

    cmd = server_command(
        topology.get("cpu"),
        "decode",
        model=MODEL,
        ports=DECODE_PORTS,
        python=PY,
        extra_env={"SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "10", "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": "3"},
    )
    assert cmd.env["SGLANG_DISAGGREGATION_WAITING_TIMEOUT"] == "10"
    assert cmd.env["SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL"] == "3"
    p, d = pd_commands(
        topology.get("cpu"), MODEL, "/runs/r", extra_env={"decode": {"SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "10"}}
    )
    assert d.env["SGLANG_DISAGGREGATION_WAITING_TIMEOUT"] == "10"
    assert "SGLANG_DISAGGREGATION_WAITING_TIMEOUT" not in p.env


# ------------------------------------------------------------------ GPU topologies


def test_2_gpu_h100_roles_exact():
    topo = topology.get("2-gpu-h100")
    p = server_command(topo, "prefill", model=MODEL, ports=PREFILL_PORTS, python=PY)
    d = server_command(topo, "decode", model=MODEL, ports=DECODE_PORTS, python=PY)
    assert list(p.argv) == [*head(PREFILL_PORTS), "--tp", "1", *prefill_mode()]
    assert list(d.argv) == [*head(DECODE_PORTS), "--tp", "1", *decode_mode()]
    # GPU runs: no CPU env, no sgl_kernel shim, no compat patch, GPUs only via Ray's CUDA_VISIBLE_DEVICES
    # (the server picks its RDMA devices for them: harness/engines/server/rdma.py).
    for cmd in (p, d):
        assert dict(cmd.env) == {**CHECKS_ENV, "HARNESS_IB_NODE_GPUS": "2"} and cmd.pythonpath == (str(SITE_DIR),)
        assert not any(a.startswith("--base-gpu-id") for a in cmd.argv)


def test_8_gpu_h200_tp4_dp_attention_exact():
    topo = topology.get("8-gpu-h200")
    p = server_command(topo, "prefill", model=MODEL, ports=PREFILL_PORTS, python=PY)
    d = server_command(topo, "decode", model=MODEL, ports=DECODE_PORTS, python=PY)
    dp_attn = ["--enable-dp-attention", "--dp-size", "4"]
    assert list(p.argv) == [*head(PREFILL_PORTS), "--tp", "4", *prefill_mode(), *dp_attn]
    assert list(d.argv) == [*head(DECODE_PORTS), "--tp", "4", *decode_mode(), *dp_attn]


def test_2_node_16_gpu_h200_tp8_exact():
    topo = topology.get("2-node-16-gpu-h200")
    p = server_command(topo, "prefill", model=MODEL, ports=PREFILL_PORTS, python=PY, host="10.0.0.1")
    d = server_command(topo, "decode", model=MODEL, ports=DECODE_PORTS, python=PY, host="10.0.0.2")
    assert list(p.argv) == [
        *head(PREFILL_PORTS)[:6],
        "10.0.0.1",
        *head(PREFILL_PORTS)[7:],
        "--tp",
        "8",
        *prefill_mode(),
    ]
    assert list(d.argv) == [*head(DECODE_PORTS)[:6], "10.0.0.2", *head(DECODE_PORTS)[7:], "--tp", "8", *decode_mode()]
    r = router_command(
        topo,
        prefill=[("http://10.0.0.1:30001", 30003)],
        decode=["http://10.0.0.2:30011"],
        port=30021,
        prometheus_port=30022,
        python=PY,
        host="10.0.0.1",
    )
    assert r.argv[3:6] == ("--host", "10.0.0.1", "--port")


@pytest.mark.parametrize("name", topology.names())
def test_every_shipped_topology_builds_every_role(name):
    topo = topology.get(name)
    for role in topo.roles:
        if role.kind == "router":
            cmd = router_command(topo, prefill=[("http://h:1", 2)], decode=["http://h:3"], port=4, prometheus_port=5)
            assert "--pd-disaggregation" in cmd.argv
        else:
            ports = PREFILL_PORTS if role.kind == "prefill" else DECODE_PORTS
            cmd = server_command(topo, role.name, model=MODEL, ports=ports)
            argv = list(cmd.argv)
            assert argv[argv.index("--disaggregation-mode") + 1] == role.kind
            assert argv[argv.index("--tp") + 1] == str(role.tp)
            assert argv[argv.index("--disaggregation-transfer-backend") + 1] == topo.transfer_backend


# ------------------------------------------------------------------ overrides, placeholders, errors


def _with_role(topo: topology.Topology, name: str, **changes) -> topology.Topology:
    from dataclasses import replace

    roles = tuple(replace(r, **changes) if r.name == name else r for r in topo.roles)
    return replace(topo, roles=roles)


def test_role_engine_args_override_cpu_defaults_once():
    topo = _with_role(topology.get("cpu"), "decode", engine_args=("--page-size", "256", "--max-total-tokens=4096"))
    argv = list(server_command(topo, "decode", model=MODEL, ports=DECODE_PORTS, python=PY).argv)
    assert argv.count("--page-size") == 1 and argv[argv.index("--page-size") + 1] == "256"
    assert "8192" not in argv and argv[-1] == "--max-total-tokens=4096"


def test_dp_and_dp_attention_from_the_role():
    topo = _with_role(topology.get("8-gpu-h200"), "decode", tp=2, dp=2, dp_attention=True, engine_args=())
    argv = list(server_command(topo, "decode", model=MODEL, ports=DECODE_PORTS, python=PY).argv)
    assert argv[argv.index("--tp") : argv.index("--tp") + 5] == ["--tp", "2", "--dp-size", "2", "--enable-dp-attention"]


def test_placeholder_ports_pass_through_for_the_worker_to_fill():
    ports = ServerPorts(http="{http}", nccl="{nccl}", bootstrap="{bootstrap}")
    argv = server_command(topology.get("cpu"), "prefill", model=MODEL, ports=ports).argv
    assert {"{http}", "{nccl}", "{bootstrap}"} <= set(argv)


def test_environ_prepends_pythonpath_and_keeps_the_rest():
    cmd = server_command(topology.get("cpu"), "decode", model=MODEL, ports=DECODE_PORTS)
    env = cmd.environ({"PYTHONPATH": "/x", "HOME": "/h"})
    assert env["PYTHONPATH"].split(":") == [str(SITE_DIR), str(CPU_SHIM_DIR), "/x"]
    assert env["HOME"] == "/h" and env["SGLANG_USE_CPU_ENGINE"] == "1"


def test_errors_name_the_problem():
    cpu = topology.get("cpu")
    with pytest.raises(LaunchError, match="bootstrap"):
        server_command(cpu, "prefill", model=MODEL, ports=DECODE_PORTS)
    with pytest.raises(LaunchError, match="router_command"):
        server_command(cpu, "router", model=MODEL, ports=DECODE_PORTS)
    with pytest.raises(KeyError, match="no role"):
        server_command(cpu, "nope", model=MODEL, ports=DECODE_PORTS)
    with pytest.raises(LaunchError, match="at least one"):
        router_command(cpu, prefill=[], decode=["http://h:1"], port=1, prometheus_port=2)


def test_launcher_imports_nothing_of_sglang():
    import subprocess
    import sys

    code = (
        "import sys; import harness.engines.server.launcher as l; "
        "bad = [m for m in sys.modules if m == 'sglang' or m.startswith('sglang.')]; "
        "sys.exit(1 if bad else 0)"
    )
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0
    assert launcher.SERVER_MODULE == "sglang.launch_server"
