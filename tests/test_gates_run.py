"""Gates end to end on a tiny sample tree (real pytest subprocesses through rerun-test's executor).

One gate with a flaky-classified failure (rerun, then passes), a crash in an informational suite
(never rerun) and passing tests → PASS with warnings, a stamped merged JUnit and a flaky record.
One gate with an accounting failure → FAIL, exit 1, a repro.json with seeds and the ledger excerpt,
which ``rerun-test --from`` reproduces with the same seeds.
"""

from __future__ import annotations

import json
import textwrap
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from harness import cli as harness_cli
from harness.gates import history, model, gate_runner
from harness.gates import gate_plan as gate_plan
from harness.commands import rerun as rerun_cli
from harness.rerun import collector, spec_resolve

pytestmark = pytest.mark.est_time(20)

_COUNT = '''
import os
from pathlib import Path


def _runs(name):
    """How many times this test has started (a file per test under $GATE_SAMPLE_STATE)."""
    p = Path(os.environ["GATE_SAMPLE_STATE"]) / name
    n = int(p.read_text()) + 1 if p.exists() else 1
    p.write_text(str(n))
    return n
'''

FILES = {
    "suites/gate/test_ok.py": """
        import pytest
        pytestmark = [pytest.mark.topology("cpu"), pytest.mark.est_time(1)]

        def test_balanced():
            assert 2 + 2 == 4

        @pytest.mark.parametrize("pages", [1, 2])
        def test_pages(pages):
            assert pages > 0
        """,
    "suites/gate/test_flaky.py": _COUNT
    + """
import pytest
pytestmark = pytest.mark.topology("cpu")


class TimingError(AssertionError):
    pass


def test_latency():
    if _runs("latency") == 1:
        raise TimingError("decode latency 12 ms > 10 ms budget")
""",
    "suites/gate/test_crash.py": _COUNT
    + """
import pytest
pytestmark = pytest.mark.topology("cpu")


def test_worker_dies():
    _runs("crash")
    raise RuntimeError("WorkerDied: worker decode-0 died (exit cause: SIGKILL)")
""",
    "suites/gate/test_ledger.py": _COUNT
    + """
import json
import os
from pathlib import Path

import pytest
pytestmark = pytest.mark.topology("cpu")


def test_release_balances(run_dir, workload_seed, request):
    _runs("ledger")
    hyp = request.config.getoption("hypothesis_seed")
    with open(Path(os.environ["GATE_SAMPLE_STATE"]) / "seeds", "a") as f:
        f.write(f"{hyp} {workload_seed}\\n")
    run_dir.worker_log("decode-0").write_text("decode-0: prealloc r1\\n")
    ev = {"seq": 0, "ts": 1.0, "kind": "prealloc", "rid": "r1", "component": "decode", "worker": "decode-0",
          "page_size": 1, "pages": {"full": [1, 2, 3]}}
    # released, keeping its pages: a leak (never released, it would only be in flight)
    done = {**ev, "seq": 1, "ts": 2.0, "kind": "release", "pages": {"full": []}}
    run_dir.ledger_file("decode-0").write_text(json.dumps(ev) + "\\n" + json.dumps(done) + "\\n")
    (run_dir.report / "pd").mkdir(parents=True, exist_ok=True)
    (run_dir.report / "pd" / "suites_gate_test_ledger.py_test_release_balances.json").write_text('{"requests": 1}')
    assert False, "ledger violation [page-leak] decode-0: 3 pages never freed"
""",
}

GATES = {
    "sample": """
        name = "sample"
        sglang_version = "0.5.23"
        [flaky]
        reruns = 2
        [seeds]
        hypothesis = 11
        workload = 22
        [[suites]]
        name = "core"
        select = ["suites/gate/test_ok.py", "suites/gate/test_flaky.py"]
        [[suites]]
        name = "crashy"
        select = ["suites/gate/test_crash.py"]
        required = false
        """,
    "broken": """
        name = "broken"
        [flaky]
        reruns = 3
        [[suites]]
        name = "accounting"
        select = ["suites/gate/"]
        topologies = ["cpu"]
        """,
}


@pytest.fixture
def repo(tmp_path, monkeypatch):
    root = tmp_path / "repo"
    for rel, body in FILES.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(textwrap.dedent(body).lstrip())
    for name, body in GATES.items():
        (root / "gates").mkdir(exist_ok=True)
        (root / "gates" / f"{name}.toml").write_text(textwrap.dedent(body))
    state = tmp_path / "state"
    state.mkdir()
    monkeypatch.setenv("GATE_SAMPLE_STATE", str(state))
    return root


def _count(name: str) -> int:
    import os

    p = Path(os.environ["GATE_SAMPLE_STATE"]) / name
    return int(p.read_text()) if p.exists() else 0


def test_flaky_rerun_crash_never_rerun_informational_and_junit(repo, tmp_path):
    gate = model.get(repo / "gates" / "sample.toml")
    lines: list[str] = []
    run_dir = tmp_path / "runs" / "one"
    result = gate_runner.run_gate(
        gate, gate_runner.GateOptions(repo_root=repo, run_dir=run_dir, jobs=2), out=lines.append
    )
    out = "\n".join(lines)
    assert result.verdict.passed and result.exit_code == 0, out
    tests = {t.nodeid: t for sv in result.verdict.suites for t in sv.outcome.tests}
    flaky = tests["suites/gate/test_flaky.py::test_latency"]
    assert flaky.attempts == ("failed", "passed") and flaky.failure_class == "timing" and flaky.flaky
    crash = tests["suites/gate/test_crash.py::test_worker_dies"]
    assert crash.attempts == ("failed",) and crash.failure_class == "crash"
    assert _count("latency") == 2 and _count("crash") == 1  # the crash ran once: never rerun
    assert any("(informational) crashy:" in w for w in result.verdict.warnings)
    assert any("test_latency [cpu] passed after 1 flaky rerun(s) (timing)" in w for w in result.verdict.warnings)
    assert "[core/cpu] running" in out or "[core/cpu] passed" in out  # live lines per group
    assert "rerun 1/2 of suites/gate/test_flaky.py::test_latency (timing)" in out
    # merged JUnit: every group and the rerun, stamped
    root = ET.parse(run_dir / "report" / "junit.xml").getroot()
    props = {s.get("name"): {p.get("name"): p.get("value") for p in s.iter("property")} for s in root.iter("testsuite")}
    assert set(props) == {"core/cpu", "core/cpu/rerun-1", "crashy/cpu"}
    for p in props.values():
        assert p["topology"] == "cpu" and p["gate"] == "sample" and p["git_sha"] == "unknown"
        assert p["sglang_version"] == "0.5.23" and p["hypothesis_seed"] == "11" and p["workload_seed"] == "22"
    assert props["core/cpu/rerun-1"]["rerun_of"] == "suites/gate/test_flaky.py::test_latency"
    assert props["crashy/cpu"]["required"] == "false"
    assert root.get("tests") == "6"  # 4 + 1 rerun + 1 crash
    res = json.loads((run_dir / "report" / "result.json").read_text())
    assert res["verdict"] == "PASS" and res["suites"][0]["counts"] == {
        "passed": 4,
        "failed": 0,
        "skipped": 0,
        "xfailed": 0,
        "flaky": 1,
    }
    assert "✅ PASS" in (run_dir / "report" / "summary.md").read_text()
    assert "suites/gate/test_ok.py::test_pages[2]" in json.loads((run_dir / "report" / "durations.json").read_text())
    # the flaky record
    records = history.read(tmp_path / "runs" / history.FILE_NAME)
    assert records[-1]["tests"]["suites/gate/test_flaky.py::test_latency"] == ["failed", "passed"]
    page = (run_dir / "report" / "index.html").read_text()
    assert "gate sample: PASS" in page and "<td>failed → passed</td><td>flaky (passed on a rerun)</td>" in page
    assert "Tests of core/cpu/rerun-1" in page
    assert [t.nodeid for t in history.flaky(records, 5)] == ["suites/gate/test_flaky.py::test_latency"]


def test_failing_gate_fails_with_repro_that_reproduces(repo, tmp_path, capsys, monkeypatch):
    # Secrets set in the environment, as the README tells joined-cluster users to: no file the failing
    # gate run writes, and no line the rerun prints, may carry their values.
    secrets = {"RAY_AUTH_TOKEN": "ray-tok-8c1f0e7d", "SGLANG_API_KEY": "sgl-key-51b2a9", "HARNESS_GH_TOKEN": "gh-3d0c"}
    for k, v in secrets.items():
        monkeypatch.setenv(k, v)
    run_dir = tmp_path / "runs" / "gate"
    rc = harness_cli.main(
        [
            "gate",
            "run",
            str(repo / "gates" / "broken.toml"),
            "--repo-root",
            str(repo),
            "--run-dir",
            str(run_dir),
            "--gpus",
            "0",
            "--hypothesis-seed",
            "5",
            "--workload-seed",
            "7",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 1, out
    assert "\nFAIL\n" in out
    assert "accounting: suites/gate/test_ledger.py::test_release_balances [cpu] accounting: " in out
    assert "test_crash.py::test_worker_dies [cpu] crash" in out
    assert _count("ledger") == 1 and _count("crash") == 1  # reruns = 3, yet neither was rerun
    res = json.loads((run_dir / "report" / "result.json").read_text())
    assert res["verdict"] == "FAIL" and res["passed"] is False
    rel = next(t["repro"] for t in res["suites"][0]["tests"] if t["nodeid"].endswith("test_release_balances"))
    bundle_path = run_dir / rel
    bundle = json.loads(bundle_path.read_text())
    assert bundle["spec"] == "suites/gate/test_ledger.py::test_release_balances" and bundle["topology"] == "cpu"
    assert bundle["seeds"]["hypothesis"] == 5 and bundle["seeds"]["workload_base"] == 7
    assert bundle["failure"]["class"] == "accounting" and bundle["sglang_version"] == "0.5.23"
    # the page: verdict, the gate's tables, the ledger-writing test's timeline with its leak at r1's event
    assert "[index.html](index.html)" in (run_dir / "report" / "summary.md").read_text()
    page = (run_dir / "report" / "index.html").read_text()
    assert '<h1 id="verdict" class="verdict fail">gate broken: FAIL</h1>' in page
    assert "<h2>Gate verdict</h2>" in page and "<h2>Flaky record</h2>" in page and "hypothesis=5, workload=7" in page
    assert page.count('<img class="timeline"') == 1 and "test_release_balances-" in page
    assert (
        '<tr class="violation" data-rule="page-leak" data-worker="decode-0" data-seq="1" data-rid="r1" data-follows="">'
        in page
    )  # a root cause: follows none
    assert bundle["workers"] == ["decode-0"] and "ledger/decode-0.jsonl" in bundle["files"]
    assert any("page-leak" in v for v in bundle["ledger_excerpt"]["decode-0"]["violations"])
    assert (bundle_path.parent / "workers" / "decode-0.log").read_text() == "decode-0: prealloc r1\n"
    assert (
        "report/pd/suites_gate_test_ledger.py_test_release_balances.json" in bundle["files"]
    )  # the suite's own report
    assert "env" in bundle["environment"] and bundle["engine_args"].keys() >= {"prefill", "decode"}
    assert bundle["environment"]["env"]["RAY_AUTH_TOKEN"] == "<present>"
    leaked = [
        f"{f.relative_to(run_dir)}: {k}"
        for f in run_dir.rglob("*")
        if f.is_file()
        for k, v in secrets.items()
        if v.encode() in f.read_bytes()
    ]
    assert not leaked, leaked
    first_seeds = Path(tmp_path / "state" / "seeds").read_text().split()
    assert first_seeds[0] == "5" and int(first_seeds[1]) == bundle["seeds"]["workload"]

    monkeypatch.setenv("RAY_AUTH_TOKEN", "ray-tok-another-run")  # a rerun elsewhere holds another token
    monkeypatch.delenv("SGLANG_API_KEY")
    rc = rerun_cli.main(
        ["--from", str(bundle_path), "--repo-root", str(repo), "--run-dir", str(tmp_path / "repro"), "--gpus", "0"]
    )
    out = capsys.readouterr().out
    assert rc == 1, out
    assert "ray-tok" not in out and "sgl-key" not in out and "RAY_AUTH_TOKEN" not in out  # same presence: no line
    assert "differs: env.SGLANG_API_KEY: set → (unset)" in out
    assert "REPRODUCED: suites/gate/test_ledger.py::test_release_balances failed again (same class)" in out
    assert "[repro/cpu] failed  1/1 failed 1" in out  # the live line
    assert _count("ledger") == 2
    assert Path(tmp_path / "state" / "seeds").read_text().splitlines() == [" ".join(first_seeds)] * 2  # same seeds
    assert (tmp_path / "repro" / "report" / "junit.xml").is_file()


def test_repro_not_reproduced_and_bad_bundle(repo, tmp_path, capsys):
    bundle = {
        "version": 1,
        "spec": "suites/gate/test_ok.py::test_balanced",
        "topology": "cpu",
        "seeds": {"hypothesis": 1, "workload_base": 2, "workload": 3},
        "failure": {"class": "assertion"},
    }
    path = tmp_path / "repro.json"
    path.write_text(json.dumps(bundle))
    rc = rerun_cli.main(
        ["--from", str(path), "--repo-root", str(repo), "--run-dir", str(tmp_path / "r"), "--gpus", "0"]
    )
    out = capsys.readouterr().out
    assert rc == 0 and "NOT REPRODUCED: suites/gate/test_ok.py::test_balanced passed" in out
    path.write_text(json.dumps({**bundle, "seeds": {"hypothesis": "x"}}))
    assert rerun_cli.main(["--from", str(path), "--repo-root", str(repo)]) == 2
    err = capsys.readouterr().err
    assert (
        err.strip() == f"rerun-test: {path}: seeds.hypothesis and seeds.workload_base must be integers; fix the bundle"
    )
    path.write_text(json.dumps({**bundle, "topology": "8-gpu-h200"}))
    assert rerun_cli.main(["--from", str(path), "--repo-root", str(repo)]) == 2
    assert "no longer runs on 8-gpu-h200 (it declares cpu)" in capsys.readouterr().err
    # A tampered bundle: wrong types, and a tree outside the repository and the target cache, are refused in
    # one line before any target is selected (a bundle must not choose which code is imported).
    for tampered, says in (
        ({"engine": ["x"]}, "engine must be a string or null"),
        ({"seeds": {"hypothesis": 1, "workload_base": 2**70}}, "seeds.workload_base must be an integer"),
        (
            {"sglang": {"origin": "tree", "spec": "t", "root": str(tmp_path / "evil"), "version": "0.5.23"}},
            "lies outside the repository and the target cache; give --sglang to choose the target",
        ),
    ):
        path.write_text(json.dumps({**bundle, **tampered}))
        assert rerun_cli.main(["--from", str(path), "--repo-root", str(repo)]) == 2
        err = capsys.readouterr().err
        assert says in err and err.count("\n") == 1 and "Traceback" not in err, err


def test_selection_errors_are_suite_failures(repo):
    reg = collector.collect(repo)
    entry = model.GateSuite(name="x", select=("suites/none/",))
    with pytest.raises(spec_resolve.ResolveError, match="'suites/none/' holds no registered suite file with tests"):
        gate_plan.select(entry, reg)
    entry = model.GateSuite(name="x", select=("suites/gate/test_ok.py",), topologies=("2-gpu-h100",))
    with pytest.raises(Exception, match="selects no test declared for 2-gpu-h100; the selected tests run on cpu"):
        gate_plan.entry_plan(entry, reg, simulate=True)
    p = gate_plan.entry_plan(model.GateSuite(name="x", select=("suites/gate/",)), reg, simulate=False)
    assert [g.topology for g in p.groups] == ["cpu"] and not p.groups[0].allow_simulation
    assert len(p.groups[0].items) == 5  # test_pages is one item (its cases are found by pytest)


def test_gate_cli_bad_input(capsys):
    assert harness_cli.main(["gate", "show", "nightly"]) == 2
    assert capsys.readouterr().err.startswith("harness: unknown gate 'nightly'; use one of: per-commit, release")
    assert harness_cli.main(["gate", "run", "per-commit", "--simulate", "--ray-address", "h:1"]) == 2
    assert "pass only one" in capsys.readouterr().err
    assert harness_cli.main(["flaky", "--last", "0"]) == 2


def test_gpu_group_without_simulate_fails_with_the_fix(repo, tmp_path):
    (repo / "suites" / "gpu").mkdir()
    (repo / "suites" / "gpu" / "test_two_gpus.py").write_text(
        'import pytest\npytestmark = pytest.mark.topology("2-gpu-h100")\n\ndef test_pair():\n    pass\n'
    )
    gate = model.Gate(name="gpu", suites=(model.GateSuite(name="pd", select=("suites/gpu/",)),))
    lines: list[str] = []
    result = gate_runner.run_gate(
        gate, gate_runner.GateOptions(repo_root=repo, run_dir=tmp_path / "runs" / "g"), out=lines.append
    )
    assert result.exit_code == 1
    assert result.verdict.reasons == (
        "pd: [2-gpu-h100] needs 2 GPUs, this machine has 0; pass --simulate to run it on Ray logical GPUs, "
        "or run on runner 2-gpu-h100",
        "pd: no test ran (0 skipped); a gate needs evidence",
    )
    assert "[pd/2-gpu-h100] not run: needs 2 GPUs" in "\n".join(lines)


def test_a_gate_whose_required_dsv4_server_tests_skip_fails_naming_them(tmp_path):
    """The real DeepSeek-V4 server suite under --simulate: every test skips (it needs real GPUs), so
    the entry requiring it fails, naming each skipped test and why, instead of passing on nothing."""
    repo_root = Path(__file__).resolve().parents[1]
    dsv4 = "suites/disaggregation/test_disaggregation_dsv4_server.py"
    assert dsv4 in model.get("release").suite("pd").require
    gate = model.Gate(name="dsv4", suites=(model.GateSuite(name="pd", select=(dsv4,), engine="all", require=(dsv4,)),))
    result = gate_runner.run_gate(
        gate,
        gate_runner.GateOptions(repo_root=repo_root, run_dir=tmp_path / "runs" / "g", simulate=True),
        out=lambda line: None,
    )
    assert result.exit_code == 1
    skipped = [r for r in result.verdict.reasons if r.startswith(f"pd: required test {dsv4}::")]
    assert len(skipped) == 10 and all("[8-gpu-h200] skipped: " in r and "real GPUs" in r for r in skipped)
    assert any("test_probe_ledger_holds_invariants[hisparse-on]" in r for r in skipped)


def _testcase_properties(junit_dir: Path, nodeid_tail: str) -> dict[str, str]:
    for xml in junit_dir.rglob("*.xml"):
        for case in ET.parse(xml).getroot().iter("testcase"):
            if nodeid_tail.endswith(case.get("name", "")):
                return {p.get("name"): p.get("value") for p in case.iter("property")}
    return {}


@pytest.mark.timeout(1500)
@pytest.mark.est_time(45)
def test_a_failing_e2e_seed_replays_with_the_same_seed_and_workload(tmp_path, monkeypatch, capsys):
    """For real: the e2e workload on the simulated 2-GPU topology fails (one corrupted KV page, the
    harness's runtime fault, reaches the Ray ranks through HARNESS_FAULTS); the gate stores the seed
    in repro.json and ``rerun-test --from`` runs the same seed, i.e. the same 200 requests."""
    repo_root = Path(__file__).resolve().parents[1]
    monkeypatch.setenv("HARNESS_FAULTS", "corrupt-kv-page")
    spec = "suites/e2e/test_swa_accounting.py::test_randomized_workload_ledger_balances[radix-off]"
    gate = model.Gate(
        name="e2e",
        suites=(model.GateSuite(name="e2e", select=(spec,), engine="sim", topologies=("2-gpu-h100",)),),
        workload_seed=4242,
    )
    run_dir = tmp_path / "runs" / "gate"
    result = gate_runner.run_gate(
        gate, gate_runner.GateOptions(repo_root=repo_root, run_dir=run_dir, simulate=True), out=lambda line: None
    )
    assert result.exit_code == 1
    [(key, rel)] = result.repros.items()
    bundle = json.loads((run_dir / rel).read_text())
    # The corrupted page: the ledger's digest rule ([kv-content]) names it first where the KV digests run,
    # else the PD ranks' own content check (KVCorruption).
    said = bundle["failure"]["message"]
    assert bundle["failure"]["class"] == "accounting" and ("[kv-content]" in said or "KVCorruption" in said), said
    seed = bundle["seeds"]["workload"]
    first = _testcase_properties(run_dir / "suites", spec)
    assert first["workload_seed"] == str(seed) and first["workload_fingerprint"]
    log = (run_dir / rel).parent / "pytest.log"
    assert f"workload_seed={seed} (base 4242)" in log.read_text(), "the failing seed is printed"

    rc = rerun_cli.main(
        [
            "--from",
            str(run_dir / rel),
            "--repo-root",
            str(repo_root),
            "--run-dir",
            str(tmp_path / "repro"),
            "--gpus",
            "0",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 1 and "REPRODUCED" in out and "(same class)" in out, out
    again = _testcase_properties(tmp_path / "repro", spec)
    assert (again["workload_seed"], again["workload_fingerprint"]) == (str(seed), first["workload_fingerprint"])


def test_two_long_node_ids_that_differ_past_the_cut_get_two_evidence_directories():
    # Before: names were cut at 120 characters, so the basic server suite's [prefill] / [decode] pair shared one
    # repro directory and the second failure overwrote the first's bundle.
    from harness.rundir import safe_name

    base = (
        "suites/disaggregation/test_disaggregation_basic_server.py::"
        "test_a_server_killed_while_kv_is_in_flight_frees_every_page_on_the_side_left["
    )
    prefill, decode = safe_name(base + "prefill]"), safe_name(base + "decode]")
    assert prefill != decode and len(prefill) <= 120 and len(decode) <= 120
    assert safe_name("../..") == "_"  # never a path out of the run directory
