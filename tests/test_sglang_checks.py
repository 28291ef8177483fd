"""sglang's own checks as a second oracle (:mod:`harness.targets.sglang.compat.checks`): which a target
has (read from its source), that every server and simulated rank the harness starts gets them, and
that a hit is its own evidence class, accounting for the gates, attributed to sglang in the fault
check. The tests that trip each check in a real run are in ``tests/test_sglang_checks_trip.py``."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness import ledger
from harness.faultcheck import verdicts
from harness.faultcheck.verdicts import BROKEN, CAUGHT, SuiteRun, build_cells
from harness.gates.classify import classify
from harness.engines.sim.deploy import worker_env
from harness.plugins.explain import headline
from harness.targets.sglang.compat import checks
from harness.engines.server.launcher import ServerPorts, server_command
from harness.topology import get as load_topology
from harness.workers import WorkerDied

Outcome = verdicts.TestOutcome
PEER = "RuntimeError: invariant-check FAILED [swa.peer_released]: is_true: caller wants free_segment"
IDLE = "ValueError: token_to_kv_pool_allocator memory leak detected! available_size=8064, total_size=8192"


def _tree(tmp_path: Path, environ: str, swa: str = "") -> Path:
    srt = tmp_path / "sglang" / "srt"
    (srt / "mem_cache" / "allocator").mkdir(parents=True)
    (srt / "environ.py").write_text(environ)
    (srt / "mem_cache" / "allocator" / "swa.py").write_text(swa)
    return tmp_path


def test_what_a_target_has_is_read_from_its_source(tmp_path):
    every = "\n".join(f"    {c.env} = EnvInt(0)" for c in checks.CHECKS)
    contracts = 'Invariant("swa.peer_mapped", ...)\nInvariant("swa.peer_released", ...)'
    have, why = checks.present(_tree(tmp_path / "full", every, contracts))
    assert have == checks.CHECKS and why == {}
    # a release without the named SWA contracts (0.5.19) and one without the busy check's variable
    partial = every.replace("SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY", "SOMETHING_ELSE")
    have, why = checks.present(_tree(tmp_path / "old", partial))
    assert "mem-check-busy" not in {c.name for c in have}
    assert why == {
        "invariant-strict": "no swa.peer_mapped, swa.peer_released contract",
        "mem-check-busy": "sglang/srt/environ.py has no SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY",
    }
    root = tmp_path / "old"
    assert "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY" not in checks.environment(root)
    assert checks.environment(root)["SGLANG_INVARIANT_CHECK"] == "2"  # it runs, without those contracts
    assert checks.summary(root).endswith(
        "missing in this target: invariant-strict (no swa.peer_mapped, swa.peer_released "
        "contract); mem-check-busy (sglang/srt/environ.py has no "
        "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY)"
    )


def test_the_installed_target_has_every_check():
    from harness.targets.sglang import selection

    have, why = checks.present(Path(selection.current().root))
    assert have == checks.CHECKS and why == {}


def test_which_checks_are_on_is_chosen_by_one_variable(monkeypatch):
    monkeypatch.delenv(checks.SELECT_ENV, raising=False)
    assert checks.environment(None) == {
        "SGLANG_INVARIANT_CHECK": "2",
        "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY": "1",
        "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "1",
        "SGLANG_CHECK_KV_PAGE_INVARIANTS": "1",
        "SGLANG_DEBUG_MEMORY_POOL": "1",
    }
    monkeypatch.setenv(checks.SELECT_ENV, "0")  # all off, sglang's default-on idle check too
    assert set(checks.environment(None).values()) == {"0"}
    assert checks.summary(None) == "sglang checks: all off (HARNESS_SGLANG_CHECKS=0)"
    monkeypatch.setenv(checks.SELECT_ENV, "mem-check-busy")
    assert {k for k, v in checks.environment(None).items() if v != "0"} == {
        "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY"
    }
    monkeypatch.setenv(checks.SELECT_ENV, "mem-check-busy,nope")
    with pytest.raises(checks.UnknownCheck, match="no sglang check named nope; known: invariant-strict"):
        checks.environment(None)


def test_a_bad_selection_is_one_line_before_any_group_runs(monkeypatch, capsys):
    from harness.commands.rerun import main

    monkeypatch.setenv(checks.SELECT_ENV, "strict")
    assert main(["test_hisparse_allocator.py"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "no sglang check named strict" in err


@pytest.mark.parametrize("topology", ["cpu", "2-gpu-h100"])
def test_every_server_and_rank_runs_with_the_checks_on(topology, monkeypatch):
    monkeypatch.delenv(checks.SELECT_ENV, raising=False)
    topo = load_topology(topology)
    ports = ServerPorts(http=1, nccl=2, bootstrap=3)
    for role in (topo.roles_of("prefill")[0].name, topo.roles_of("decode")[0].name):
        env = server_command(topo, role, model="m", ports=ports).env
        assert {k: env[k] for k in checks.environment(None)} == checks.environment(None)
    assert worker_env().items() >= checks.environment(None).items()
    monkeypatch.setenv(checks.SELECT_ENV, "0")
    env = server_command(topo, topo.roles_of("decode")[0].name, model="m", ports=ports).env
    assert {env[c.env] for c in checks.CHECKS} == {"0"} and {worker_env()[c.env] for c in checks.CHECKS} == {"0"}


def test_a_hit_is_its_own_class_naming_the_check_and_what_it_names():
    assert checks.hit(PEER)[0].name == "invariant-strict"
    kind, line = headline(RuntimeError(PEER.split(": ", 1)[1]))
    assert kind == "sglang-check"
    assert line.startswith("sglang-check [invariant-strict: swa.peer_released] RuntimeError: invariant-check FAILED")
    # a server whose scheduler the idle check took down: found in the dead worker's log tail
    tail = (
        '  File "/v/sglang/srt/managers/scheduler_components/invariant_checker.py", line 440, in _report_leak\n'
        f"{IDLE}\n"
    )
    kind, line = headline(WorkerDied("pd-cpu-decode-0", "process exited with code 1", tail))
    assert kind == "sglang-check"
    assert line == (
        "sglang-check [mem-check-idle: token_to_kv_pool_allocator] "
        + IDLE
        + " | last sglang frame: sglang/srt/managers/scheduler_components/invariant_checker.py:440 in _report_leak"
    )
    # the harness's oracle leads when it saw the break too; sglang's check follows it
    broken = ledger.LedgerBroken(
        [ledger.Violation("page-leak", "pool 'swa': 1 page(s) never freed", None, "decode-0", "r1")]
    )
    broken.__cause__ = RuntimeError(PEER)
    kind, line = headline(broken)
    assert kind == "ledger" and line.startswith("ledger [page-leak]")
    assert "; sglang's check agreed: [invariant-strict: swa.peer_released]" in line


def test_a_hit_is_accounting_for_the_gates_even_when_it_took_a_server_down():
    assert (
        classify("failure", "sglang-check [mem-check-idle: token_to_kv_pool_allocator] worker pd-cpu-decode-0 died")
        == "accounting"
    )


def _run(label: str, *outcomes: verdicts.TestOutcome) -> SuiteRun:
    return SuiteRun(
        label,
        ("suites/x.py",),
        1 if any(o.outcome == "failed" for o in outcomes) else 0,
        outcomes,
        1.0,
        Path("j.xml"),
        Path("l.log"),
        frozenset({label}),
    )


def test_the_fault_check_attributes_each_catch_to_its_oracle():
    clean = _run(
        "clean", Outcome("suites/x.py::a", "suites/x.py", "passed"), Outcome("suites/x.py::b", "suites/x.py", "passed")
    )
    both = _run(
        "f",
        Outcome(
            "suites/x.py::a",
            "suites/x.py",
            "failed",
            "ledger [page-leak] ...; sglang's check agreed: [invariant-strict: swa.peer_released] ...",
        ),
        Outcome("suites/x.py::b", "suites/x.py", "passed"),
    )
    (cell,) = build_cells("f", ("suites/x.py",), clean, both, evidence=("[page-leak]",))
    assert cell.status == CAUGHT and cell.by_sglang == ("suites/x.py::a",)
    # caught by sglang's check alone: the harness's own oracle missed it, and that is not a catch
    only = _run(
        "f",
        Outcome("suites/x.py::a", "suites/x.py", "failed", "sglang-check [mem-check-idle: swa] ..."),
        Outcome("suites/x.py::b", "suites/x.py", "passed"),
    )
    (cell,) = build_cells("f", ("suites/x.py",), clean, only, evidence=("[page-leak]",))
    assert cell.status == BROKEN and "caught by sglang's own check only, not the harness's oracle" in cell.reason
