"""The run report of a real run, opened in headless Chromium.

One real ``rerun-test`` run of a tiny PD suite (two ledger-writing tests on the 2-gpu-h100 topology,
simulated, and one plain test) with the fault ``swa-tail-short`` injected (``_swa_tail_len`` rounds the
window start up a page: the tail stays page-aligned, so sglang's own asserts stay quiet, but it loses
the window): the short test's prompts fit in the window and pass, the long one's decode preallocs keep
a tail one page short and fail. The page is opened in Chromium over the DevTools protocol; the test
asserts the verdict text, one rendered timeline image per ledger-writing test, that the first rule row
of the failing test is the root cause ``swa-tail-short`` (the knock-ons after it, each naming it), marked
at the event the ledger checker names (request and pages), that the failure's message leads with the
rule and the suspect sglang function, and no console errors, and keeps a screenshot in the run
directory (``report/screenshot.png``).

Without chromium the test skips with the install line, except under CI (``CI=true``), where it fails.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import browser
from harness import faults, ledger
from harness.report import records as run_records
from harness.faults import source
from harness.targets.sglang import selection as target

pytestmark = pytest.mark.est_time(25)

REPO = Path(__file__).resolve().parents[1]
FAULT = "swa-tail-short"

SUITE = """
import pytest

from harness.engines.sim.driver import run
from harness.engines.sim.workload import KVSpec, PDRequest

pytestmark = [pytest.mark.topology("2-gpu-h100"), pytest.mark.timeout(300)]

SPEC = KVSpec(kind="swa", page_size=64, window=100, full_tokens=24 * 64, swa_tokens=12 * 64, req_slots=4)


def test_short_prompts(pd_pair, pd_report):
    # prompt + decode stay inside the window: nothing to evict, the fault changes nothing
    res = run(pd_pair(SPEC), [PDRequest(f"s{i}", 40 + 10 * i, decode_steps=3) for i in range(3)])
    pd_report(res)
    res.assert_clean()


def test_long_decode(pd_pair, pd_report):
    # 120 decode steps slide the window over several pages: each must be evicted
    res = run(pd_pair(SPEC), [PDRequest(f"l{i}", 150 + 20 * i, decode_steps=120) for i in range(2)])
    pd_report(res)
    res.assert_clean()


def test_no_ledger():
    assert True
"""


@pytest.fixture(scope="module")
def chromium_exe() -> str:
    exe = browser.find()
    if exe is None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"chromium is missing in CI; ./dev install must install it ({browser.INSTALL_LINE})")
        pytest.skip(f"chromium not installed; install it with: {browser.INSTALL_LINE}")
    return exe


@pytest.fixture(scope="module")
def faulted_run(
    chromium_exe: str, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, subprocess.CompletedProcess]:
    assert FAULT in faults.catalog()
    base = tmp_path_factory.mktemp("report-run")
    tree = base / "pdtiny"
    tree.mkdir()
    (tree / "test_tiny_pd.py").write_text(SUITE)
    run_dir = base / "run"
    # The fault is a source patch: its scratch copy goes first on every process's import path, as
    # --inject-fault does (rerun-test passes the environment to its pytest and Ray workers).
    patched = base / "patched"
    source.scratch_copy([FAULT], patched, target.sglang_root().resolve())
    env = {
        **os.environ,
        faults.ENV_VAR: FAULT,
        "RAY_DEDUP_LOGS": "0",
        target.OVERLAY_ENV: str(patched),
        "PYTHONPATH": os.pathsep.join(p for p in (str(patched), os.environ.get("PYTHONPATH", "")) if p),
    }
    cmd = [
        sys.executable,
        "-m",
        "harness.commands.rerun",
        "--suites-dir",
        str(tree),
        "--run-dir",
        str(run_dir),
        "--jobs",
        "1",
        "test_tiny_pd.py",
    ]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=540)
    return run_dir, proc


@pytest.mark.timeout(600)
def test_report_page_of_a_faulted_run_in_chromium(faulted_run):
    run_dir, proc = faulted_run
    page_path = run_dir / "report" / "index.html"
    assert proc.returncode == 1, f"rerun-test exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert proc.stdout.strip().splitlines()[-1] == f"report: {page_path}"  # what ./dev run ends with
    [group_dir] = (run_dir / "groups").iterdir()
    records = {r.suffix: r for r in run_records.read_records(group_dir)}
    writers = sorted(s for s, r in records.items() if r.ledgers)
    assert writers == ["::test_long_decode", "::test_short_prompts"] and not records["::test_no_ledger"].ledgers

    # The event the page must mark first: the root cause of the failing test's violations (the
    # rule the fault's evidence names first), not a knock-on of it.
    long_events = [e for span in records["::test_long_decode"].ledgers for e in run_records.span_events(span)]
    causes = ledger.root_causes(ledger.check(long_events))
    first = causes[0].root
    assert first.rule == "swa-tail-short" and f"[{first.rule}]" in faults.get(FAULT).evidence, causes
    event = next(e for e in long_events if e.worker == first.worker and e.seq == first.seq)

    with browser.chromium() as page:
        start = time.monotonic()
        page.open(page_path.as_uri())
        load_s = time.monotonic() - start
        verdict = page.evaluate("document.getElementById('verdict').textContent")
        images = page.evaluate("""[...document.querySelectorAll('section.test')].map(s => ({
            id: s.querySelector('h3').textContent, outcome: s.dataset.outcome,
            imgs: [...s.querySelectorAll('img.timeline')].map(i => [i.complete, i.naturalWidth, i.naturalHeight])}))""")
        marks = page.evaluate("""[...document.querySelectorAll('tr.violation')].map(r => ({rule: r.dataset.rule,
            worker: r.dataset.worker, seq: r.dataset.seq, rid: r.dataset.rid, follows: r.dataset.follows,
            label: r.cells[0].textContent, text: r.textContent,
            test: r.closest('section.test').querySelector('h3').textContent}))""")
        message = page.evaluate("""[...document.querySelectorAll('section.test')]
            .filter(s => s.dataset.outcome == 'failed').map(s => s.querySelector('.msg').textContent)""")
        shot = page.screenshot(run_dir / "report" / "screenshot.png")
        errors = list(page.errors)

    assert verdict == "rerun-test: FAIL"
    by_test = {s["id"].split("::")[-1]: s for s in images}
    assert {k: s["outcome"] for k, s in by_test.items()} == {
        "test_short_prompts": "passed",
        "test_long_decode": "failed",
        "test_no_ledger": "passed",
    }
    for name in ("test_short_prompts", "test_long_decode"):  # one rendered timeline per ledger-writing test
        [(complete, width, height)] = by_test[name]["imgs"]
        assert complete and width > 500 and height > 200, (name, width, height)
    assert by_test["test_no_ledger"]["imgs"] == []
    rows = [m for m in marks if m["test"].endswith("::test_long_decode")]
    top = rows[0]  # the first rule row is the root cause, marked at its event
    assert (top["rule"], top["follows"], top["label"]) == ("swa-tail-short", "", "V1"), rows
    assert (top["worker"], top["seq"], top["rid"]) == (event.worker, str(event.seq), event.rid)
    assert f"#{event.seq} {event.kind}" in top["text"] and ledger.RULES[first.rule] in top["text"]
    knock_ons = [m for m in rows[1:] if m["follows"]]
    assert all(m["follows"].startswith("V") for m in knock_ons) and {m["follows"] for m in knock_ons} <= {
        m["label"] for m in rows if not m["follows"]
    }, rows
    [failed_message] = message
    assert failed_message.startswith("ledger [swa-tail-short] "), failed_message
    assert "suspect: sglang/srt/disaggregation/decode.py DecodePreallocQueue._swa_tail_len" in failed_message
    assert not [m for m in marks if m["test"].endswith("::test_short_prompts")]
    assert errors == [], f"console errors: {errors}"
    assert shot.stat().st_size > 10_000
    print(json.dumps({"page_load_s": round(load_s, 3), "page_bytes": page_path.stat().st_size}))
