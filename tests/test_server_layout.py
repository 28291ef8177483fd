"""Real servers on GPU topologies, as far as a CPU machine can check them: placement shape (one bundle per
server process), the GPU ids each server process gets on a simulated cluster, and the exact DeepSeek-V4
TP4+TP4 command lines of the 8-gpu-h200 suite (hisparse off and on)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from harness import topology
from harness.engines.server.launcher import (
    HISPARSE_DECODE_ARGS,
    SITE_DIR,
    LaunchError,
    ServerPorts,
    plain_server_command,
    router_command,
)
from harness.targets.sglang.compat import checks
from harness.engines.server.layout import PLAIN_ROLE, SHARED_GPU_MEM_FRACTION, server_layout
from harness.engines.server.stack import PLACEHOLDER_PORTS, pd_commands

pytestmark = pytest.mark.est_time(6)

PY = "/venv/bin/python"
MODEL = "/models/dsv4"
#: sglang's own checks, on in every server (harness/targets/sglang/compat/checks.py).
CHECKS_ENV = checks.environment(None)
CPU_BUNDLE = {"CPU": 0.1}


def bundles(layout, role):
    return layout.placement.role(role).bundles()


# ------------------------------------------------------------------ layout


def test_cpu_is_placed_as_before():
    topo = topology.get("cpu")
    layout = server_layout(topo)
    assert layout.placement is topo
    assert (layout.plain_role, layout.plain_beside_pd, dict(layout.extra_args)) == (None, True, {})


def test_2_gpu_h100_decode_and_plain_share_one_gpu_with_half_the_memory_each():
    layout = server_layout(topology.get("2-gpu-h100"))
    assert bundles(layout, "prefill") == [{**CPU_BUNDLE, "GPU": 1.0}]
    assert bundles(layout, "decode") == [{**CPU_BUNDLE, "GPU": 0.5}]
    assert bundles(layout, PLAIN_ROLE) == [{**CPU_BUNDLE, "GPU": 0.5}]
    assert bundles(layout, "router") == [CPU_BUNDLE]
    assert layout.placement.role(PLAIN_ROLE).node == layout.placement.role("decode").node
    assert (layout.plain_role, layout.plain_beside_pd) == (PLAIN_ROLE, True)
    fraction = ("--mem-fraction-static", SHARED_GPU_MEM_FRACTION)
    assert (layout.args_of("prefill"), layout.args_of("decode"), layout.args_of(PLAIN_ROLE)) == ((), fraction, fraction)


def test_8_gpu_h200_one_four_gpu_bundle_per_server_and_no_room_for_plain_beside():
    layout = server_layout(topology.get("8-gpu-h200"))
    assert bundles(layout, "prefill") == [{**CPU_BUNDLE, "GPU": 4.0}]
    assert bundles(layout, "decode") == [{**CPU_BUNDLE, "GPU": 4.0}]
    assert [r.name for r in layout.placement.roles] == ["prefill", "decode", "router"]
    assert (layout.plain_role, layout.plain_beside_pd, dict(layout.extra_args)) == (None, False, {})
    assert layout.placement.total_gpus == 8


def test_2_node_16_gpu_h200_tp8_servers_stay_on_their_nodes():
    layout = server_layout(topology.get("2-node-16-gpu-h200"))
    p, d = layout.placement.role("prefill"), layout.placement.role("decode")
    assert (p.bundles(), p.node) == ([{**CPU_BUNDLE, "GPU": 8.0}], 0)
    assert (d.bundles(), d.node) == ([{**CPU_BUNDLE, "GPU": 8.0}], 1)
    assert layout.plain_beside_pd is False


def test_spare_gpus_give_the_plain_server_its_own_bundle():
    topo = topology.get("2-gpu-h100")
    topo = replace(topo, gpus_per_node=4)
    layout = server_layout(topo)
    assert bundles(layout, "decode") == [{**CPU_BUNDLE, "GPU": 1.0}]
    assert bundles(layout, PLAIN_ROLE) == [{**CPU_BUNDLE, "GPU": 1.0}]
    assert dict(layout.extra_args) == {}


def test_a_server_larger_than_a_node_is_refused():
    topo = topology.get("8-gpu-h200")
    big = replace(topo, roles=tuple(replace(r, tp=16) if r.name == "prefill" else r for r in topo.roles))
    with pytest.raises(
        LaunchError,
        match="topology 8-gpu-h200: a prefill server needs 16 GPUs in one process, "
        "a node has 8; use a TP group that fits one node",
    ):
        server_layout(big)


def test_a_role_of_several_instances_is_refused_for_real_servers():
    """A stack starts one server per role: ``4-node-32-gpu-h200``'s two TP8 instances per role run
    simulated only, not as one wrongly placed server (``--show-commands`` once printed 16 GPUs on node 0)."""
    with pytest.raises(
        LaunchError,
        match=r"^topology 4-node-32-gpu-h200: prefill has 2 instances, and a real server "
        r"stack starts one server per role; run it simulated",
    ):
        server_layout(topology.get("4-node-32-gpu-h200"))


def test_dp_replicas_without_attention_dp_multiply_the_gpus():
    topo = topology.get("8-gpu-h200")
    dp = replace(
        topo,
        roles=tuple(
            replace(r, tp=2, dp=2, dp_attention=False, engine_args=()) if r.kind in ("prefill", "decode") else r
            for r in topo.roles
        ),
    )
    assert bundles(server_layout(dp), "decode") == [{**CPU_BUNDLE, "GPU": 4.0}]
    attn = replace(dp, roles=tuple(replace(r, dp_attention=True) if r.kind == "decode" else r for r in dp.roles))
    assert bundles(server_layout(attn), "decode") == [{**CPU_BUNDLE, "GPU": 2.0}]


# ------------------------------------------------------------------ GPU ids on a simulated cluster


def _start_probe(name, group, run_dir):
    from harness.workers import InProcess, Probe, WorkerSpec, start_worker

    return start_worker(WorkerSpec(name, InProcess(Probe), run_dir=run_dir), group)


@pytest.mark.parametrize("name", ["8-gpu-h200", "2-gpu-h100"])
def test_each_server_process_sees_every_gpu_of_its_group(ray_cluster, tmp_path, name):
    if not ray_cluster.simulate:
        pytest.skip("needs the simulated session cluster (--simulate on a machine without GPUs)")
    from harness.workers import procs

    topo = topology.get(name)
    layout = server_layout(topo)
    placement = ray_cluster.place(layout.placement)
    workers = []
    try:
        for role in ("prefill", "decode", *([layout.plain_role] if layout.plain_role else [])):
            workers.append(_start_probe(f"{name}-{role}", placement.of(role)[0], tmp_path))
        ids = {w.name.rsplit("-", 1)[1]: list(w.gpu_ids) for w in workers}
        for w in workers:
            assert w.call("env", "CUDA_VISIBLE_DEVICES") == ",".join(map(str, w.gpu_ids)), w.name
        tp = topo.role("prefill").tp
        assert len(ids["prefill"]) == len(ids["decode"]) == tp, ids
        assert not set(ids["prefill"]) & set(ids["decode"]), f"prefill and decode share GPUs: {ids}"
        if layout.plain_role:
            assert ids[PLAIN_ROLE] == ids["decode"], f"the plain server should share decode's GPU: {ids}"
    finally:
        for w in workers:
            w.stop(grace=1.0)
        ray_cluster.release(placement)
    pids = [p for w in workers if w.info for p in (w.info.pid, w.info.payload_pid) if p]
    assert procs.wait_gone(pids, 10) == []


# ------------------------------------------------------------------ DeepSeek-V4 TP4+TP4 on 8-gpu-h200

DSV4_PARALLEL = ["--tp", "4", "--enable-dp-attention", "--dp-size", "4"]


def dsv4_head(http="{http}", nccl="{nccl}"):
    return [
        PY,
        "-m",
        "sglang.launch_server",
        "--model-path",
        MODEL,
        "--host",
        "127.0.0.1",
        "--port",
        http,
        "--nccl-port",
        nccl,
    ]


@pytest.mark.parametrize("hisparse", [False, True], ids=["hisparse-off", "hisparse-on"])
def test_dsv4_pd_commands_exact(tmp_path, hisparse):
    topo = topology.get("8-gpu-h200")
    extra = {"decode": HISPARSE_DECODE_ARGS} if hisparse else None
    p, d = pd_commands(topo, MODEL, tmp_path, names=("prefill", "decode"), extra_args=extra)
    # The suite's stack, as ServerStacks.pd builds it (python is the harness's own interpreter).
    p, d = (replace(c, argv=(PY, *c.argv[1:])) for c in (p, d))
    assert list(p.argv) == [
        *dsv4_head(),
        "--tp",
        "4",
        "--disaggregation-mode",
        "prefill",
        "--disaggregation-transfer-backend",
        "mooncake",
        "--disaggregation-bootstrap-port",
        "{bootstrap}",
        "--enable-dp-attention",
        "--dp-size",
        "4",
    ]
    assert list(d.argv) == [
        *dsv4_head(),
        "--tp",
        "4",
        "--disaggregation-mode",
        "decode",
        "--disaggregation-transfer-backend",
        "mooncake",
        "--enable-dp-attention",
        "--dp-size",
        "4",
        *(["--enable-hisparse", "--disable-radix-cache"] if hisparse else []),
    ]
    # GPU recipe: no CPU env, shim or compat patch; the probe writes the decode ledger (prefill's: flushes only).
    assert dict(p.env) == {
        "HARNESS_PROBE_LEDGER": str(tmp_path / "ledger" / "prefill.jsonl"),
        "HARNESS_PROBE_WORKER": "prefill",
        "HARNESS_PROBE_COMPONENT": "prefill",
        **CHECKS_ENV,
        "HARNESS_IB_NODE_GPUS": "8",
    }
    assert p.pythonpath == (str(SITE_DIR),)
    assert dict(d.env) == {
        "HARNESS_PROBE_LEDGER": str(tmp_path / "ledger" / "decode.jsonl"),
        "HARNESS_PROBE_WORKER": "decode",
        "HARNESS_PROBE_COMPONENT": "decode",
        **CHECKS_ENV,
        "HARNESS_IB_NODE_GPUS": "8",
    }
    assert not any(a.startswith(("--base-gpu-id", "--page-size", "--device")) for a in (*p.argv, *d.argv))


def test_dsv4_plain_baseline_and_router_exact():
    topo = topology.get("8-gpu-h200")
    plain = plain_server_command(topo, model=MODEL, ports=PLACEHOLDER_PORTS, python=PY)
    assert list(plain.argv) == [*dsv4_head(), *DSV4_PARALLEL]  # decode's TP4 shape, no disaggregation
    assert dict(plain.env) == CHECKS_ENV  # sglang's own checks on: the only environment a GPU server gets
    r = router_command(
        topo, prefill=[("http://127.0.0.1:1", 2)], decode=["http://127.0.0.1:3"], port=4, prometheus_port=5, python=PY
    )
    assert list(r.argv) == [
        PY,
        "-m",
        "harness.engines.server.router",
        "--host",
        "127.0.0.1",
        "--port",
        "4",
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        "5",
        "--pd-disaggregation",
        "--policy",
        "round_robin",
        "--prefill",
        "http://127.0.0.1:1",
        "2",
        "--decode",
        "http://127.0.0.1:3",
    ]


@pytest.mark.parametrize("hisparse", [False, True], ids=["hisparse-off", "hisparse-on"])
def test_dsv4_commands_parse_as_meant_by_sglangs_own_parser(tmp_path, hisparse):
    """sglang 0.5.23's launch_server parser reads each command as meant (a renamed flag fails here)."""
    import argparse

    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(prog="sglang serve")
    ServerArgs.add_cli_args(parser)
    topo = topology.get("8-gpu-h200")
    p, d = pd_commands(topo, MODEL, tmp_path, extra_args={"decode": HISPARSE_DECODE_ARGS} if hisparse else None)
    plain = plain_server_command(topo, model=MODEL, ports=PLACEHOLDER_PORTS)
    ports = {"{http}": "30000", "{nccl}": "30001", "{bootstrap}": "30002"}
    for cmd, mode in ((p, "prefill"), (d, "decode"), (plain, "null")):
        assert cmd.argv[1:3] == ("-m", "sglang.launch_server")
        ns = parser.parse_args([ports.get(a, a) for a in cmd.argv[3:]])
        assert (ns.model_path, ns.tp_size, ns.dp_size, ns.enable_dp_attention) == (MODEL, 4, 4, True), cmd.role
        assert ns.disaggregation_mode == mode and ns.disaggregation_transfer_backend == "mooncake", cmd.role
        on = hisparse and mode == "decode"
        assert (ns.enable_hisparse, ns.disable_radix_cache) == (on, on), cmd.role
    assert parser.parse_args([ports.get(a, a) for a in p.argv[3:]]).disaggregation_bootstrap_port == 30002


def test_ports_placeholder_shape_is_what_the_worker_fills():
    assert PLACEHOLDER_PORTS == ServerPorts(http="{http}", nccl="{nccl}", bootstrap="{bootstrap}")
