"""``rerun-test --show-commands``: the GPU stack's server commands, checked against sglang's own PD fixture.

sglang ships the fixture its PD tests start servers with
(``sglang/test/server_fixtures/disaggregation_fixture.py``, class ``PDDisaggregationServerBase``). Its
source is read from the installed release at test time and its own code run: ``setUpClass`` (its CI
branch: mooncake, ``--disaggregation-ib-device`` from the node's RDMA devices), ``start_prefill``,
``start_decode`` and ``launch_lb``, on the shape of each GPU topology (TP sizes, the role's engine
arguments, decode's first GPU after prefill's). Only what the fixture imports from sglang is replaced
(importing ``sglang.test.test_utils`` needs packages the CPU set lacks and takes seconds): the process
starts record their command instead, and ``torch`` says the node has the topology's GPUs. Every flag
it passes must be in ours, with the same value where the value is the shape (mode, TP, DP, transfer
backend, RDMA devices), except the deliberate differences in :data:`DELIBERATE`, each with its reason.
"""

from __future__ import annotations

import ast
import importlib.util
import sys
import types
from pathlib import Path

import pytest

from harness import topology
from harness.commands import rerun
from harness.engines.server import rdma, showcmd
from harness.engines.server.launcher import SITE_DIR
from harness.engines.server.layout import server_gpus

FIXTURE = Path("test") / "server_fixtures" / "disaggregation_fixture.py"
#: What the fixture's CI branch finds on a node (``SGLANG_CI_RDMA_ALL_DEVICES``); ours gets the same.
NICS = tuple(f"mlx5_{i}" for i in range(8))
#: Flags whose value is the shape, so it must be the fixture's; the others (ports, host, model) are
#: placeholders or the harness's own leases here, only present.
SAME_VALUE = {
    "--tp",
    "--dp-size",
    "--enable-dp-attention",
    "--disaggregation-mode",
    "--disaggregation-transfer-backend",
    "--disaggregation-ib-device",
    "--pd-disaggregation",
}
#: Flags the fixture passes that ours leaves out on purpose: role -> flag -> why.
DELIBERATE = {
    "prefill": {
        "--trust-remote-code": "the models are local directories of architectures sglang implements itself "
        "(tiny-llama, tiny-mellum-swa, DeepSeek-V4): no code from a model directory runs; "
        "a topology's engine_args can add it for a model that needs its own",
    },
    "decode": {
        "--trust-remote-code": "as prefill",
        "--base-gpu-id": "Ray's CUDA_VISIBLE_DEVICES narrows each server to the GPUs of its bundle, so its "
        "first GPU is always 0 inside it (launcher.py)",
        "--disaggregation-bootstrap-port": "the router is given each prefill's bootstrap port (--prefill URL PORT) "
        "and passes it with every request; the fixture's router is not, so its "
        "decode falls back to its own flag, which must then equal prefill's",
    },
    "router": {
        "--mini-lb": "the fixture's own FIXME ('remove this'); the harness runs sglang-router's Rust router "
        "by default, the Python MiniLB only when a test asks (mini_lb=True)",
    },
}


def _fixture_path() -> Path:
    spec = importlib.util.find_spec("sglang")
    assert spec is not None and spec.submodule_search_locations, "sglang is not installed: run ./dev install"
    path = Path(list(spec.submodule_search_locations)[0]) / FIXTURE
    if not path.is_file():
        pytest.fail(
            f"the installed sglang has no {FIXTURE} (0.5.23 ships it): the comparison has nothing to compare against",
            pytrace=False,
        )
    return path


def _load_fixture(path: Path, stubs: dict) -> dict:
    """Run the fixture's source with its ``from sglang... import`` lines bound to ``stubs`` instead."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    body = []
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("sglang"):
            unknown = [a.name for a in node.names if a.name not in stubs]
            assert not unknown, f"the fixture now imports {unknown} from {node.module}: give the test a stand-in"
            continue
        body.append(node)
    tree.body = body
    ns = {"__name__": "disaggregation_fixture", "__file__": str(path), **stubs}
    exec(compile(tree, str(path), "exec"), ns)  # noqa: S102 - sglang's own fixture, from the installed release
    return ns


def _flags(args: list[str]) -> dict[str, list[str]]:
    """``--flag -> its values`` (a flag without values maps to [])."""
    out: dict[str, list[str]] = {}
    flag = None
    for a in args:
        if a.startswith("--"):
            flag = a
            out[flag] = []
        elif flag is not None:
            out[flag].append(a)
    return out


def fixture_commands(name: str, monkeypatch) -> dict[str, dict[str, list[str]]]:
    """The flags sglang's fixture passes to prefill, decode and the router for topology ``name``'s shape."""
    topo = topology.get(name)
    prefill, decode = topo.role("prefill"), topo.role("decode")
    seen: dict[str, list[str]] = {}

    def popen_launch_pd_server(
        model, base_url, timeout, api_key=None, other_args=(), env=None, return_stdout_stderr=None
    ):
        host, port = base_url.rsplit("//", 1)[1].split(":")
        # test_utils.popen_launch_pd_server's own argv: the model first, the caller's, then host and port.
        args = ["--model-path", model, *map(str, other_args), "--host", host, "--port", port]
        seen[_flags(args)["--disaggregation-mode"][0]] = args

    def popen_with_error_check(command, *a, **k):
        seen["router"] = command[command.index("sglang_router.launch_router") + 1 :]

    envs = types.SimpleNamespace(
        SGLANG_TEST_PD_DISAGG_BACKEND=types.SimpleNamespace(get=lambda: "mooncake"),
        SGLANG_TEST_PD_DISAGG_DEVICES=types.SimpleNamespace(get=lambda: None),
    )
    stubs = dict(
        envs=envs,
        kill_process_tree=lambda *a, **k: None,
        DEFAULT_TIMEOUT_FOR_SERVER_LAUNCH=600,
        DEFAULT_URL_FOR_TEST="http://127.0.0.1:21000",
        CustomTestCase=object,
        is_in_ci=lambda: True,
        popen_launch_pd_server=popen_launch_pd_server,
        popen_with_error_check=popen_with_error_check,
        start_subprocess_fail_fast_watcher=lambda *a, **k: None,
        terminate_and_kill_process_tree=lambda *a, **k: None,
        wait_for_http_ready=lambda *a, **k: None,
    )
    ns = _load_fixture(_fixture_path(), stubs)
    # What its setUpClass sets in os.environ is undone after the test; the node it sees: our NICs, our GPUs.
    for var in ("MC_TCP_ENABLE_CONNECTION_POOL", "MC_GID_INDEX", "UCX_NET_DEVICES"):
        monkeypatch.setenv(var, "preset-by-the-test")
    monkeypatch.setenv("SGLANG_CI_RDMA_ALL_DEVICES", ",".join(NICS))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    fake_torch = types.SimpleNamespace(cuda=types.SimpleNamespace(device_count=lambda: topo.gpus_per_node))
    monkeypatch.setitem(sys.modules, "torch", fake_torch)
    shape = type(
        "Shape",
        (ns["PDDisaggregationServerBase"],),
        dict(
            model="{model}",
            prefill_tp_size=prefill.tp,
            decode_tp_size=decode.tp,
            decode_base_gpu_id=server_gpus(prefill),
            extra_prefill_args=list(prefill.engine_args),
            extra_decode_args=list(decode.engine_args),
        ),
    )
    shape.setUpClass()
    shape.start_prefill()
    shape.start_decode()
    shape.launch_lb()
    return {role: _flags(args) for role, args in seen.items()}


def our_commands(name: str) -> dict[str, dict[str, list[str]]]:
    cmds = showcmd.stack_commands(topology.get(name), environ={rdma.DEVICES_ENV: ",".join(NICS)})
    return {rc.role: _flags(rc.server_args()) for rc in cmds}


@pytest.mark.parametrize("name", ["2-gpu-h100", "8-gpu-h200"])
def test_every_flag_of_sglangs_pd_fixture_is_in_ours(name, monkeypatch):
    theirs, ours = fixture_commands(name, monkeypatch), our_commands(name)
    assert set(theirs) == {"prefill", "decode", "router"}, f"the fixture started {sorted(theirs)}"
    # Precondition: the fixture really took its CI branch (RDMA devices) on this shape.
    assert "--disaggregation-ib-device" in theirs["prefill"] and "--disaggregation-ib-device" in theirs["decode"]
    problems = []
    for role, flags in theirs.items():
        for flag, value in flags.items():
            why = DELIBERATE.get(role, {}).get(flag)
            if why:
                if flag in ours[role]:
                    problems.append(
                        f"{role}: {flag} is listed as a deliberate difference but ours has it; drop it from DELIBERATE"
                    )
            elif flag not in ours[role]:
                problems.append(f"{role}: the fixture passes {flag} {' '.join(value)}, ours does not")
            elif flag in SAME_VALUE and ours[role][flag] != value:
                problems.append(f"{role}: {flag} is {ours[role][flag]} in ours, {value} in the fixture")
    for role, flags in DELIBERATE.items():
        for flag in flags:
            if flag not in theirs[role]:
                problems.append(f"{role}: the fixture no longer passes {flag}; drop it from DELIBERATE")
    assert not problems, "\n".join(problems)


def test_8_gpu_h200_servers_get_the_nics_of_their_gpus():
    ours = our_commands("8-gpu-h200")
    assert ours["prefill"]["--disaggregation-ib-device"] == ["mlx5_0,mlx5_1,mlx5_2,mlx5_3"]
    assert ours["decode"]["--disaggregation-ib-device"] == ["mlx5_4,mlx5_5,mlx5_6,mlx5_7"]


def test_show_commands_prints_each_role(capsys, monkeypatch):
    monkeypatch.setenv(rdma.DEVICES_ENV, "mlx5_0,mlx5_1")
    assert rerun.main(["--show-commands", "2-gpu-h100"]) == 0
    out = capsys.readouterr().out
    assert "# prefill (node 0, GPUs 0)\nCUDA_VISIBLE_DEVICES=0 \\\n" in out
    assert "# decode (node 0, GPUs 1)\nCUDA_VISIBLE_DEVICES=1 \\\n" in out
    assert "--disaggregation-ib-device mlx5_1\n" in out  # decode's GPU 1 of 2 on two NICs
    assert "--prefill 'http://{prefill.host}:{prefill.http}' '{prefill.bootstrap}' \\\n" in out


def test_show_commands_bad_topology_is_one_line(capsys):
    assert rerun.main(["--show-commands", "3-gpu-nope"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("rerun-test: --show-commands 3-gpu-nope: unknown topology")


def _nic(root: Path, name: str, state: str = "4: ACTIVE", rate: str = "400 Gb/sec (4X NDR)") -> None:
    port = root / name / "ports" / "1"
    port.mkdir(parents=True)
    (port / "state").write_text(state + "\n")
    (port / "rate").write_text(rate + "\n")


def test_node_devices_keep_active_fast_rdma_ports_only(tmp_path):
    _nic(tmp_path, "mlx5_1")
    _nic(tmp_path, "mlx5_0")
    _nic(tmp_path, "mlx5_2", state="1: DOWN")
    _nic(tmp_path, "mlx5_3", rate="25 Gb/sec (1X EDR)")
    _nic(tmp_path, "mlx5_eth0")
    (tmp_path / "mlx5_4").mkdir()  # no port 1
    assert rdma.node_devices(tmp_path, {}) == ("mlx5_0", "mlx5_1")
    assert rdma.node_devices(tmp_path, {rdma.DEVICES_ENV: "ib7, ib8"}) == ("ib7", "ib8")
    assert rdma.node_devices(tmp_path / "absent", {}) == ()


def test_complete_argv_adds_the_flag_once_and_only_when_asked(tmp_path):
    env = {rdma.NODE_GPUS_ENV: "8", "CUDA_VISIBLE_DEVICES": "2,3", rdma.DEVICES_ENV: "a,b,c,d"}
    assert rdma.complete_argv(["--tp", "2"], env, tmp_path) == ["--tp", "2", rdma.FLAG, "b"]
    assert rdma.complete_argv(["--tp", "2", rdma.FLAG, "x"], env, tmp_path) == ["--tp", "2", rdma.FLAG, "x"]
    assert rdma.complete_argv(["--tp"], {**env, rdma.NODE_GPUS_ENV: ""}, tmp_path) == ["--tp"]
    assert rdma.complete_argv(["--tp"], {**env, "CUDA_VISIBLE_DEVICES": "GPU-uuid"}, tmp_path) == ["--tp"]
    assert rdma.complete_argv(["--tp"], {**env, rdma.DEVICES_ENV: ""}, tmp_path) == ["--tp"]


def test_a_server_process_gets_the_flag_from_its_sitecustomize(tmp_path):
    """The real path: a ``python -m sglang.launch_server`` process with the server's PYTHONPATH and
    env (a stand-in module prints what sglang would parse; its children and other commands are left alone)."""
    import subprocess

    pkg = tmp_path / "sglang"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "launch_server.py").write_text("import sys\nprint(sys.argv[1:])\n")
    (pkg / "other.py").write_text("import sys\nprint(sys.argv[1:])\n")
    env = {
        "PATH": "/usr/bin:/bin",
        "PYTHONPATH": f"{SITE_DIR}:{tmp_path}",
        rdma.NODE_GPUS_ENV: "2",
        "CUDA_VISIBLE_DEVICES": "1",
        rdma.DEVICES_ENV: "mlx5_0,mlx5_1",
    }
    run = [sys.executable, "-m"]
    server = subprocess.run(
        [*run, "sglang.launch_server", "--tp", "1"], env=env, capture_output=True, text=True, timeout=60
    )
    assert server.stdout.strip() == "['--tp', '1', '--disaggregation-ib-device', 'mlx5_1']", server.stderr
    other = subprocess.run([*run, "sglang.other", "--tp", "1"], env=env, capture_output=True, text=True, timeout=60)
    assert other.stdout.strip() == "['--tp', '1']", other.stderr
