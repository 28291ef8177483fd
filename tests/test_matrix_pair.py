"""``harness matrix --pair P,D``: each server's sglang chosen per role in the launcher, the pair's verdict
(pure, from hand-built request outcomes), and bad input as one line and exit 2 before anything starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness import cli as harness_cli
from harness import topology
from harness.engines.server import launcher
from harness.engines.server.launcher import CPU_SHIM_DIR, SITE_DIR, ServerPorts, server_command
from harness.rerun import pair_matrix as pairs
from harness.rerun.pair_matrix import Sent
from harness.targets.sglang import selection

pytestmark = pytest.mark.est_time(3)

_CORE = {
    "disaggregation/decode.py": (
        "class DecodePreallocQueue:\n    def _swa_tail_len(self, seq_len):\n        pass\n\n"
        "def alloc_for_decode_prealloc(allocator):\n    pass\n"
    ),
    "mem_cache/allocator/swa.py": "class SWATokenToKVPoolAllocator:\n    pass\n",
    "runtime_context.py": (
        "class RuntimeContext:\n    def override_server_args(self, **fields):\n        pass\n\n"
        "def get_context():\n    pass\n"
    ),
}


def _tree(root: Path, version: str) -> Path:
    """A source tree the resolver accepts: ``sglang/`` with the core the harness drives and no
    ``--disaggregation-decode-retraction-backup`` (as 0.5.16 / 0.5.17)."""
    srt = root / "sglang" / "srt"
    for rel, text in _CORE.items():
        (srt / rel).parent.mkdir(parents=True, exist_ok=True)
        (srt / rel).write_text(text)
    (root / "sglang" / "__init__.py").write_text("")
    (root / "sglang" / "_version.py").write_text(f"__version__ = version = '{version}'\n")
    (srt / "server_args.py").write_text("class ServerArgs:\n    page_size: int = 1\n")
    return root


def _commands(monkeypatch, **role_targets: str):
    for kind, name in launcher.ROLE_TARGET_ENV.items():
        monkeypatch.delenv(name, raising=False)
        if kind in role_targets:
            monkeypatch.setenv(name, role_targets[kind])
    monkeypatch.delenv(selection.ENV_VAR, raising=False)
    cpu = topology.get("cpu")
    p = server_command(cpu, "prefill", model="/m", ports=ServerPorts(http=1, nccl=2, bootstrap=3))
    d = server_command(cpu, "decode", model="/m", ports=ServerPorts(http=4, nccl=5))
    return p, d


def test_decode_runs_its_own_target_and_prefill_the_runs(tmp_path, monkeypatch):
    tree = _tree(tmp_path / "old", "0.5.17")
    p, d = _commands(monkeypatch, decode=str(tree))
    # Decode's server selects the tree (its sitecustomize reads HARNESS_SGLANG), imports it ahead of the
    # run's target, and gets only the flags the tree has: no retraction backup before 0.5.18.
    assert d.env[selection.ENV_VAR] == str(tree)
    assert d.pythonpath[:3] == (str(SITE_DIR), str(CPU_SHIM_DIR), str(tree))
    assert "--disaggregation-decode-retraction-backup" not in d.argv
    assert selection.ENV_VAR not in p.env and p.pythonpath == (str(SITE_DIR), str(CPU_SHIM_DIR))
    # Without a role's target, decode is the run's (installed 0.5.23 here) and gets the flag.
    p2, d2 = _commands(monkeypatch)
    assert "--disaggregation-decode-retraction-backup" in d2.argv
    assert selection.ENV_VAR not in d2.env and d2.pythonpath == (str(SITE_DIR), str(CPU_SHIM_DIR))


def test_the_installed_target_as_a_role_still_goes_first_on_the_path(monkeypatch):
    # The run may have a release first on its path: a role on 'installed' names its directory ahead of it.
    _, d = _commands(monkeypatch, decode="installed")
    installed = selection.resolve("installed")
    assert d.env[selection.ENV_VAR] == "installed" and d.pythonpath[2] == installed.root


def _sent(n, got=(1, 2), **kw):
    return Sent(n, (1, 2), got, **kw)


UP = {"prefill": True, "decode": True}


@pytest.mark.parametrize(
    "sent, alive, errors, problems, want",
    [
        ([_sent(20), _sent(64)], UP, {}, [], "pass"),
        ([_sent(20), _sent(64, got=(1, 3))], UP, {}, [], "finding"),  # diverged from plain
        ([_sent(20), _sent(64, got=None, error="timed out", timed_out=True)], UP, {}, [], "finding"),  # a hang
        ([_sent(20, None, error="HTTP 500: x"), _sent(64)], UP, {"prefill": "E", "decode": "E"}, [], "finding"),
        (
            [_sent(20, None, error="HTTP 500: x"), _sent(64, None, error="HTTP 500: x")],
            UP,
            {"prefill": "ValueError: page size", "decode": "RuntimeError: page size"},
            [],
            "refusal",
        ),
        ([_sent(20, None, error="HTTP 500: x")], UP, {"prefill": "E"}, [], "finding"),  # decode said nothing
        ([_sent(20)], {"prefill": True, "decode": False}, {}, [], "finding"),
        ([_sent(20)], UP, {}, ["decode: not-baseline"], "finding"),
    ],
)
def test_verdict(sent, alive, errors, problems, want):
    found, evidence = pairs.verdict(sent, alive, errors, problems)
    assert found == want, evidence
    assert evidence and "\n" not in evidence


def test_a_hang_names_what_each_side_logged():
    sent = [_sent(20, None, error="timed out", timed_out=True)]
    found, evidence = pairs.verdict(sent, UP, {"decode": "Error fetching prefill server info", "prefill": ""}, [])
    assert found == "finding" and evidence.startswith("hang: ") and "decode: Error fetching prefill" in evidence


def test_error_line_is_the_first_that_reports_one():
    log = "INFO start\nINFO ready\nERROR  KV transfer failed: page size 32 != 64\nTraceback ...\n"
    assert pairs.error_line(log) == "ERROR  KV transfer failed: page size 32 != 64"
    assert pairs.error_line("INFO all fine\n") == ""


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--pair", "0.5.21"], "give two targets"),
        (["--pair", "0.5.21,"], "give two targets"),
        (["--pair", "0.5.21,0.5.23,0.5.22"], "give two targets"),
        (["--pair", "0.5.21,0.5.23", "--sglang", "0.5.21"], "one of the two"),
        (["--pair", "0.5.21,0.5.23", "test_x.py"], "takes no specs"),
        (["--pair", "0.5.21,0.5.23", "--ray-address", "h:1"], "drop --ray-address"),
        (["--pair", "0.5.14,0.5.23"], "older than the supported range"),
        (["--pair", "installed,/no/such/tree"], "no such file or directory"),
        ([], "one of the two"),
    ],
)
def test_bad_pair_input_is_one_line_and_exit_2(argv, says, capsys, tmp_path):
    assert harness_cli.main(["matrix", "--run-dir", str(tmp_path / "r"), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and "\n" not in err, err
    assert not (tmp_path / "r").exists(), "nothing may run (or be written) on bad input"


def test_the_same_target_twice_is_a_pair():
    assert pairs.parse_pair(" 0.5.23 ,0.5.23") == ("0.5.23", "0.5.23")


def test_tables_name_each_pair_verdict_and_evidence():
    rows = [pairs.PairResult("0.5.21", "0.5.23", "pass", "4 requests token-identical", 61.2)]
    text, md = pairs.render_text(rows), pairs.render_markdown(rows)
    assert "0.5.21" in text and "pass" in text and "61s" in text and "4 requests token-identical" in text
    assert md.splitlines()[2] == "| 0.5.21 | 0.5.23 | pass | 4 requests token-identical | 61s |"
    assert pairs.to_json(rows)["pairs"][0]["wall_s"] == 61.2


def test_phase_points_install_on_a_release_without_abort_notices_or_drain_acks(tmp_path):
    """The real stack's probe (``hold``) on a release that has neither (0.5.18's connection classes, reduced
    to what the install touches): nothing of them is wrapped, the rest is, and the server does not die."""
    import types

    from harness.engines.server import hold

    class CommonKVManager:
        def __init__(self):
            self.request_status = {}

        def update_status(self, room, status):
            self.request_status[room] = status

    class MooncakeKVManager(CommonKVManager):
        def send_kvcache(self, *args):
            return 0

    class MooncakeKVSender:
        def poll(self):
            return None

    common = types.ModuleType("common_conn")
    common.CommonKVManager = CommonKVManager
    mooncake = types.ModuleType("mooncake_conn")
    mooncake.MooncakeKVManager, mooncake.MooncakeKVSender = MooncakeKVManager, MooncakeKVSender
    points = hold.Points(str(tmp_path / "ledger.jsonl"), "prefill", "prefill")
    send = MooncakeKVManager.send_kvcache
    hold._install_status(points, common)
    hold._install_mooncake(points, mooncake)
    assert not hasattr(MooncakeKVManager, "_handle_abort_notification") and not hasattr(
        CommonKVManager, "note_abort_ack"
    )
    assert MooncakeKVManager.send_kvcache is not send  # the chunk writes are still phase points

    # 0.5.21's decode: a deferred release with no observer (first in 0.5.22).
    class DecodePreallocQueue:
        def _pre_alloc(self, req):
            return None

    class DecodeTransferQueue:
        def _commit_transfer_to_req(self, dr):
            return None

        def _do_release(self, dr):
            return None

    decode = types.ModuleType("decode")
    decode.DecodePreallocQueue, decode.DecodeTransferQueue = DecodePreallocQueue, DecodeTransferQueue
    release = DecodeTransferQueue._do_release
    hold._install_decode(points, decode)
    assert DecodeTransferQueue._do_release is not release
    assert not hasattr(DecodeTransferQueue, "_observe_deferred_kv_release")
