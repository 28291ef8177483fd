"""A joined cluster for real: two ``ray start`` nodes on this machine, reached through ``--ray-address`` only.

One cluster for the module (:mod:`raycli`): a head (topology node 0) and a worker node (node 1),
one logical GPU each, token auth off. ``harness doctor``, ``rerun-test`` and a gate run against it
with the ``2-node-2-gpu-h100`` topology (prefill pinned to node 0, decode to node 1, by the nodes'
``pd-harness/node`` labels); a wrong address is one line and exit 2; killing node 1's raylet in
the middle of a test fails that test naming the node, leaves nothing of the harness running, and
the next run on the same cluster (node 1 started again) passes. A source-tree target travels with
the run: moved away on the driver once joined, each node's worker still imports it (and the harness)
from the copy Ray unpacked on that node; a node whose ``import sglang`` would give another tree is
refused in one line, and so is a tree Ray cannot ship (over its package size).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from harness.clock import wait_for
from harness.targets.sglang.version import read_version
from harness.workers import procs
from joined import REPO, TOPOLOGY, clean_env, harness, linked_tree, rerun_test, run, worker_actors
from raycli import CliCluster, free_ports, two_nodes

log = logging.getLogger(__name__)

pytestmark = [pytest.mark.timeout(900), pytest.mark.est_time(60)]

CROSS_NODE = "suites/smoke/test_cross_node.py"


@pytest.fixture(scope="module")
def cli_cluster():
    with two_nodes("pj-", env={"RAY_AUTH_MODE": "disabled"}) as cluster:
        yield cluster


@pytest.fixture
def env(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    return clean_env(home, tmp_path / "procs")


def _no_harness_process_left(cluster: CliCluster, procs_dir: Path) -> None:
    """No worker actor or probe on any node (Ray reaps a finished driver's actors within seconds), and
    nothing the run registered is alive."""
    for node in cluster.nodes:
        wait_for(lambda: not worker_actors(node), 30.0, f"no harness actor left on node {node.index}")
    registered = [e for e in _entries(procs_dir) if procs.alive(e["pid"], e["start"])]
    assert registered == [], f"registered processes still alive: {registered}"


def _entries(procs_dir: Path) -> list[dict]:
    return [json.loads(f.read_text()) for f in procs_dir.glob("*.json")] if procs_dir.is_dir() else []


def test_doctor_places_prefill_and_decode_on_their_nodes_and_calls_the_gpus_logical(cli_cluster, env, tmp_path):
    done = harness(
        env, "doctor", TOPOLOGY, "--ray-address", cli_cluster.address, "--json", "--run-dir", str(tmp_path / "run")
    )
    report = json.loads(done.out[done.out.index("{") :])
    rows = {(r["check"], r["detail"].split(" ")[0]): r for r in report["rows"]}
    by_check = {}
    for r in report["rows"]:
        by_check.setdefault(r["check"], []).append(r)
    groups = {r["detail"].split(" ")[0]: r for r in by_check["placement.group"]}
    assert groups["prefill-0"]["status"] == "passed" and groups["prefill-0"]["node"].startswith("node0/")
    assert groups["decode-0"]["status"] == "passed" and groups["decode-0"]["node"].startswith("node1/")
    assert [r["status"] for r in by_check["software.driver"]] == ["passed"], rows
    # The nodes were asked: 1 Ray GPU each and no device, so the GPU rows say logical, and doctor fails.
    counts = by_check["gpu.count"]
    assert {r["node"].split("/")[0] for r in counts} == {"node0", "node1"}
    assert all(r["status"] == "failed" and "logical GPUs" in r["detail"] for r in counts), counts
    assert done.rc == 1
    _no_harness_process_left(cli_cluster, Path(env["HARNESS_PROCS_DIR"]))


def test_rerun_test_runs_the_cross_node_suite_and_reports_logical_gpus(cli_cluster, env, tmp_path):
    done = rerun_test(cli_cluster, env, tmp_path / "run", CROSS_NODE)
    assert done.rc == 0, done.out
    assert f"joined Ray cluster at {cli_cluster.address}" in done.out
    assert "node0/" in done.out and "node1/" in done.out and "1 logical GPU(s)" in done.out
    assert f"{TOPOLOGY}" in done.out and "(joined, logical GPUs)" in done.out
    summary = json.loads((tmp_path / "run" / "report" / "summary.json").read_text())
    [group] = summary["groups"]
    assert group["properties"]["gpus"] == "joined, logical GPUs"
    assert [c["outcome"] for c in group["cases"]] == ["passed"]
    _no_harness_process_left(cli_cluster, Path(env["HARNESS_PROCS_DIR"]))


def test_a_gate_runs_on_the_joined_cluster(cli_cluster, env, tmp_path):
    gate = tmp_path / "joined.toml"
    gate.write_text(
        textwrap.dedent(f"""\
        name = "joined"
        description = "the cross-node smoke suite on a joined cluster"
        sglang_version = "0.5.23"
        min_pass_rate = 1.0
        timeout = 600

        [[suites]]
        name = "cross-node"
        select = ["{CROSS_NODE}"]
        """)
    )
    done = harness(
        env, "gate", "run", str(gate), "--ray-address", cli_cluster.address, "--run-dir", str(tmp_path / "run")
    )
    assert done.rc == 0, done.out
    assert "PASS" in done.out and f"joined Ray cluster at {cli_cluster.address}" in done.out
    result = json.loads((tmp_path / "run" / "report" / "result.json").read_text())
    assert result["passed"] is True, result


def test_unreachable_address_is_one_line_and_exit_2(cli_cluster, env, tmp_path):
    host = cli_cluster.address.rpartition(":")[0]
    [port] = free_ports(1)
    done = rerun_test(cli_cluster, env, tmp_path / "run", CROSS_NODE, address=f"{host}:{port}")
    assert done.rc == 2
    assert done.lines() == [done.lines()[0]] and done.lines()[0].startswith(
        f"rerun-test: cannot join the Ray cluster at {host}:{port}: unreachable: "
    ), done.out
    assert not (tmp_path / "run" / "groups").exists(), "a group started although the cluster cannot be joined"


def test_an_address_that_is_not_ray_is_one_line_and_exit_2(cli_cluster, env, tmp_path):
    with socket.socket() as listener:  # accepts connections, speaks no gRPC
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        address = f"127.0.0.1:{listener.getsockname()[1]}"
        # Silence is waited out: a 3 s deadline instead of the default 15 s (HARNESS_JOIN_TIMEOUT).
        done = harness({**env, "HARNESS_JOIN_TIMEOUT": "3"}, "doctor", TOPOLOGY, "--ray-address", address)
    assert done.rc == 2
    [line] = done.lines()
    assert line.startswith(f"harness: cannot join the Ray cluster at {address}: not-ray: "), line
    assert "no Ray GCS answered within 3 s" in line, line


def test_a_target_too_large_to_ship_is_one_line_and_exit_2(cli_cluster, env, tmp_path):
    # Ray packages the tree when the run joins and refuses a package over its gRPC message size (here
    # lowered to 4 MiB for the driver; its default is 512 MiB). The run says so in one line naming the
    # target and what to do, before any group starts.
    tree = linked_tree(tmp_path / "tree")
    (tree / "sglang" / "srt" / "weights.bin").write_bytes(os.urandom(6 << 20))  # 6 MiB that do not compress
    done = run(
        [
            "rerun-test",
            "--ray-address",
            cli_cluster.address,
            "--sglang",
            str(tree),
            "--run-dir",
            str(tmp_path / "run"),
            CROSS_NODE,
        ],
        {**env, "RAY_max_grpc_message_size": str(4 << 20)},
    )
    assert done.rc == 2, done.out
    [line] = done.lines()
    assert line.startswith(
        f"rerun-test: cannot join the Ray cluster at {cli_cluster.address}: carry: cannot ship sglang"
    ), line
    assert str(tree.resolve()) in line and "exceeds the maximum size" in line and "leave large files" in line, line
    assert not (tmp_path / "run" / "groups").exists(), "a group started although the target could not be shipped"


BLOCKING_SUITE = """
import os, signal, time
from pathlib import Path

import pytest

from harness.plugins.state import FAILFAST_SIGNAL
from harness.workers import InProcess

pytestmark = pytest.mark.topology("{topology}")


def test_blocks_while_its_decode_node_is_lost(pd_workers):
    pd_workers("prefill", InProcess("threading:Event"))
    decode = pd_workers("decode", InProcess("threading:Event"))
    flag = Path(os.environ["JOINED_FLAG"])
    flag.write_text(str(time.time()))
    try:
        decode.call("wait", 300, timeout=400)  # blocks in node 1's worker until the node is gone
    finally:
        # Ray's error and the harness's fail-fast signal may both report the death: the second one
        # must not land inside this write (it did, leaving the file empty, on a loaded machine).
        signal.pthread_sigmask(signal.SIG_BLOCK, {{FAILFAST_SIGNAL}})
        try:
            flag.with_suffix(".end").write_text(str(time.time()))
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {{FAILFAST_SIGNAL}})
"""


def test_node_loss_fails_the_test_naming_the_node_and_the_next_run_works(cli_cluster, env, tmp_path, record_property):
    suite = tmp_path / "suite" / "test_blocking.py"
    suite.parent.mkdir()
    suite.write_text(BLOCKING_SUITE.format(topology=TOPOLOGY))
    flag = tmp_path / "flag"
    out = tmp_path / "pytest.log"
    argv = [
        sys.executable,
        "-m",
        "pytest",
        str(suite),
        "--ray-address",
        cli_cluster.address,
        "--topology",
        TOPOLOGY,
        "--run-dir",
        str(tmp_path / "run"),
        "-p",
        "no:cacheprovider",
        "-q",
        "--timeout",
        "300",
        "--rootdir",
        str(suite.parent),
    ]
    with open(out, "wb") as log_file:
        proc = subprocess.Popen(
            argv,
            cwd=REPO,
            env={**env, "JOINED_FLAG": str(flag)},
            stdout=log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    try:

        def blocking() -> bool:
            if proc.poll() is not None:
                raise AssertionError(f"pytest exited {proc.returncode} before blocking:\n{out.read_text()}")
            return flag.exists()

        wait_for(blocking, 240.0, "the test to block in its decode worker")
        time.sleep(0.5)  # the call is in flight
        worker = next(n for n in cli_cluster.nodes if n.index == 1)
        cli_cluster.kill_raylet(worker)
        killed = time.time()
        proc.wait(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()
    text = out.read_text()
    # The harness saw the node go (its raylet refuses connections), before Ray's health check would say so.
    detected = float(flag.with_suffix(".end").read_text()) - killed
    record_property("node_loss_detected_s", round(detected, 2))
    log.info("node loss detected %.2f s after the raylet was killed", detected)
    assert proc.returncode == 1, text
    assert "1 failed" in text, text
    assert "WorkerDied: worker decode-0-0 died: node lost: node1/" in text, text
    assert "stopped answering (raylet" in text, text
    assert "worker decode-0-0 log (last 50 lines" in text and "[harness] worker decode-0-0 pid" in text, text

    # Nothing of the node is left, nothing of the harness runs on the surviving node.
    assert worker.members() == []
    _no_harness_process_left(cli_cluster, Path(env["HARNESS_PROCS_DIR"]))

    # The same cluster, node 1 back: the next run passes.
    cli_cluster.remove_node(worker)
    cli_cluster.add_node(num_gpus=1, index=1)
    done = rerun_test(cli_cluster, env, tmp_path / "again", CROSS_NODE)
    assert done.rc == 0, done.out


# Joins with a tree target, moves the tree away, then starts a probe on each node: where do they import from?
TRAVEL_DRIVER = """
import json, os, sys
from pathlib import Path

from harness import topology
from harness.cluster import Cluster
from harness.targets.sglang import selection
from harness.workers import InProcess, Probe, WorkerSpec, start_worker

address, tree, run_dir = sys.argv[1:4]
target = selection.select(tree)
cluster = Cluster.join(address)  # the job carries the tree: uploaded here
os.rename(tree, tree + ".moved")  # gone from the driver's path before any worker starts
seen = {}
try:
    placement = cluster.place(topology.get("{topology}"), timeout=60)
    for role in ("prefill", "decode"):
        spec = selection.worker_spec(WorkerSpec(role, InProcess(Probe), run_dir=run_dir, ready_timeout=120), target)
        w = start_worker(spec, placement.of(role)[0], 0, timeout=120)
        try:
            seen[role] = dict(node=cluster.node_index(w.info.node_id),
                              sglang=w.call("module_file", "sglang", timeout=30),
                              harness=w.call("module_file", "harness", timeout=30),
                              target=w.call("env", "HARNESS_SGLANG", timeout=30))
        finally:
            w.stop()
finally:
    cluster.shutdown()
print("SEEN " + json.dumps(seen), flush=True)
"""


def test_a_tree_target_travels_to_every_node_and_needs_no_path_there(cli_cluster, env, tmp_path):
    tree = linked_tree(tmp_path / "tree")
    driver = tmp_path / "driver.py"
    driver.write_text(TRAVEL_DRIVER.replace("{topology}", TOPOLOGY))
    # Run from outside the repository: Ray puts the driver's working directory on every worker's path,
    # so from the repository a worker here would import the harness from there, as a node with the
    # repository at that path does; a node without it imports the harness the job carried.
    done = subprocess.run(
        [sys.executable, str(driver), cli_cluster.address, str(tree), str(tmp_path / "run")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert not tree.exists() and (tmp_path / "tree.moved").is_dir()
    seen = json.loads(done.stdout.split("SEEN ", 1)[1])
    nodes = {n.index: n for n in cli_cluster.nodes}
    assert {role: s["node"] for role, s in seen.items()} == {"prefill": 0, "decode": 1}
    for role, s in seen.items():
        # Both "nodes" share this disk: a pass must come from the node's own unpacked copy, not the driver's path.
        unpacked = str(nodes[s["node"]].temp_dir.resolve())
        for module in ("sglang", "harness"):
            assert s[module].startswith(unpacked) and "/runtime_resources/py_modules_files/" in s[module], (role, s)
        assert s["target"] == str(Path(s["sglang"]).parents[1]), s  # a server it starts re-resolves the copy
    _no_harness_process_left(cli_cluster, Path(env["HARNESS_PROCS_DIR"]))


# A node whose interpreter pins another sglang ahead of anything Ray adds to its path.
PINNING_SITE = """
import sys
sys.path.insert(0, {pinned!r})
import sglang  # noqa: F401  (imported before any harness code can select the target)
"""


def test_a_node_whose_import_would_differ_from_the_shipped_tree_is_refused_in_one_line(cli_cluster, env, tmp_path):
    tree = linked_tree(tmp_path / "tree")
    other = "0.5.22" if read_version(tree) != "0.5.22" else "0.5.21"
    pinned = linked_tree(tmp_path / "pinned", version=other)
    (pinned / "sglang" / "__init__.py").unlink()
    (pinned / "sglang" / "__init__.py").write_text("")  # a stub that imports nothing of the real package
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(PINNING_SITE.format(pinned=str(pinned)))
    node = cli_cluster.add_node(num_gpus=1, env={"PYTHONPATH": str(tmp_path / "site")})
    try:
        done = rerun_test(cli_cluster, env, tmp_path / "run", "--sglang", str(tree), CROSS_NODE)
    finally:
        cli_cluster.remove_node(node)
    assert done.rc == 2, done.out
    [line] = done.lines()
    assert line.startswith(
        f"rerun-test: cannot join the Ray cluster at {cli_cluster.address}: version skew: node{node.index}/"
    ), line
    assert f"sglang {other} from {pinned.resolve()} there, {read_version(tree)} here" in line, line
    assert "node0/" not in line and "node1/" not in line, line  # the nodes that import the shipped copy pass
    assert not (tmp_path / "run" / "groups").exists(), "a group started on a node that imports another sglang"
