"""Changed-line coverage of the target (:mod:`harness.changes`, ``rerun-test --coverage --changed``).

The measurement tests run real processes under coverage.py's own start-up (its ``.pth`` and
``COVERAGE_PROCESS_START``) over a small package named ``sglang`` written to a temporary directory,
so each case is a process kind the harness starts: a plain interpreter, a fork that ends with
``os._exit``, one killed by SIGKILL, and a thread started outside ``threading`` (as Ray runs a
threaded actor's methods). The last test runs ``rerun-test --coverage --changed HEAD`` on a git
checkout holding a link tree of the installed sglang with two functions edited.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import pr_checkout
from harness.changes import lines as change_lines
from harness.changes.lines import ChangeError
from harness.changes.measure import Measurement
from harness.changes.report import changed_coverage, markdown

REPO = Path(__file__).resolve().parent.parent


def test_changed_lines_of_a_checkout_count_edits_untracked_files_and_deletions(tmp_path):
    pkg = tmp_path / "sglang"
    pkg.mkdir()
    (pkg / "a.py").write_text("x = 1\ny = 2\nz = 3\nw = 4\n")
    (pkg / "notes.txt").write_text("not python\n")
    pr_checkout.git(tmp_path, "init", "-q")
    pr_checkout.git(tmp_path, "add", ".")
    pr_checkout.git(tmp_path, "commit", "-qm", "base")
    (pkg / "a.py").write_text("x = 1\ny = 20\nz = 3\n")  # line 2 replaced, line 4 deleted
    (pkg / "new.py").write_text("a = 1\nb = 2\n")  # untracked: every line changed
    (pkg / "notes.txt").write_text("changed, but no Python\n")
    change = change_lines.from_git(tmp_path, "HEAD")
    assert change.lines == {"sglang/a.py": frozenset({2}), "sglang/new.py": frozenset({1, 2})}
    assert change.deleted == {"sglang/a.py": 1}
    with pytest.raises(ChangeError, match="not a revision"):
        change_lines.from_git(tmp_path, "no-such-branch")


def test_changed_lines_between_two_release_trees(tmp_path):
    for name, text in (
        ("old", "def f():\n    return 1\n"),
        ("new", "def f():\n    return 2\n\n\ndef g():\n    pass\n"),
    ):
        (tmp_path / name / "sglang").mkdir(parents=True)
        (tmp_path / name / "sglang" / "m.py").write_text(text)
    change = change_lines.between_trees(tmp_path / "new", tmp_path / "old", "sglang 0.0.1")
    assert change.lines == {"sglang/m.py": frozenset({2, 3, 4, 5, 6})}
    assert change.base == "sglang 0.0.1"
    with pytest.raises(ChangeError, match="holds no sglang"):
        change_lines.between_trees(tmp_path / "new", tmp_path, "nothing")


PACKAGE = """
def by_plain():
    return max(
        1,
        0,
    )


def by_fork():
    return 2


def by_killed():
    return 3


def by_traced_thread():
    return 4


def by_untraced_thread():
    return 5


def never():
    return 6
"""

# One process per case above; each imports the package named sglang (the temporary one).
DRIVER = """
import _thread, os, signal, subprocess, sys, threading, time
import sglang
from harness.changes import measure

sglang.by_plain()
pid = os.fork()
if pid == 0:
    sglang.by_fork()
    os._exit(0)
os.waitpid(pid, 0)

done = []
def traced():
    measure.trace_this_thread()
    sglang.by_traced_thread()
    done.append(1)
def untraced():
    sglang.by_untraced_thread()
    done.append(1)
_thread.start_new_thread(traced, ())
_thread.start_new_thread(untraced, ())
while len(done) < 2:
    time.sleep(0.01)

killed = subprocess.Popen([sys.executable, "-c",
    "import os, time, sglang; sglang.by_killed(); time.sleep(1.5); os.kill(os.getpid(), 9)"])
killed.wait()
print(killed.pid)
"""


def test_every_process_kind_is_measured_and_a_killed_one_is_said_not_measured(tmp_path):
    tree = tmp_path / "tree"
    (tree / "sglang").mkdir(parents=True)
    (tree / "sglang" / "__init__.py").write_text(PACKAGE)
    m = Measurement(tmp_path / "coverage", tree)
    env = {**os.environ, **m.env("grp"), "PYTHONPATH": os.pathsep.join([str(tree), str(REPO)])}
    driver = subprocess.run(
        [sys.executable, "-c", DRIVER], env=env, check=True, timeout=120, capture_output=True, text=True
    )
    combined = m.combine()
    ran = combined.lines["sglang/__init__.py"]
    body = {
        name: PACKAGE.splitlines().index(f"def {name}():") + 2
        for name in ("by_plain", "by_fork", "by_killed", "by_traced_thread", "by_untraced_thread", "never")
    }
    assert body["by_plain"] in ran and body["by_fork"] in ran and body["by_traced_thread"] in ran
    # Lost with the SIGKILLed process (its lines are unknown), never run by the native thread that
    # did not install the hook, never called at all.
    assert body["by_killed"] not in ran and body["by_untraced_thread"] not in ran and body["never"] not in ran
    assert ran[body["by_plain"]] == {"grp"}
    lost = combined.unmeasured
    assert [p.pid for p in lost] == [int(driver.stdout.split()[-1])], lost
    assert len(combined.processes) == 3  # the driver, its fork, the killed one

    # Joined with a change that touches an argument line of by_plain's multi-line call (it counts as the
    # call's statement), by_fork and never: two of three executed, the process named.
    inside_call = body["by_plain"] + 2
    change = change_lines.Change(
        "base", {"sglang/__init__.py": frozenset({inside_call, body["by_fork"], body["never"]})}, {}
    )
    cov = changed_coverage(change, combined, tree, m.statements)
    assert (cov.executed, cov.changed) == (2, 3)
    assert [(r.function, r.missed) for r in cov.rows] == [("by_plain", []), ("by_fork", []), ("never", [body["never"]])]
    assert "1 process(es) not measured" in cov.line()
    assert "not unexecuted" in markdown(cov)


EDIT_RAN = (
    "        window_start = (window_start // page_size) * page_size\n        return seq_len - window_start\n",
    "        aligned = (window_start // page_size) * page_size\n        return seq_len - aligned\n",
)
EDIT_NEVER = (
    "    req.kv.kv_allocated_len = fill_len\n    device = allocator.device\n",
    "    allocated = fill_len\n    req.kv.kv_allocated_len = allocated\n    device = allocator.device\n",
)

SUITE = """
import types

import pytest

pytestmark = pytest.mark.topology("cpu")


def test_tail_of_a_window():
    from sglang.srt.disaggregation.decode import DecodePreallocQueue

    from harness.engines.sim import rank_runtime

    rank_runtime.publish(rank_runtime.RuntimeSettings())
    # The queue's own method on the three inputs it reads (the suites build the real queue; this
    # test is about which lines ran, not about the queue).
    queue = types.SimpleNamespace(_uses_swa_tail_prealloc=lambda: True,
                                  scheduler=types.SimpleNamespace(sliding_window_size=100),
                                  token_to_kv_pool_allocator=types.SimpleNamespace(page_size=64))
    assert DecodePreallocQueue._swa_tail_len(queue, 300) == 300 - 192
"""


@pytest.mark.est_time(40)
def test_rerun_reports_which_changed_lines_ran_and_which_never(tmp_path):
    tree, _ = pr_checkout.make(tmp_path / "repo", (EDIT_RAN, EDIT_NEVER))
    suites = tmp_path / "suites"
    suites.mkdir()
    (suites / "test_changed_tail.py").write_text(textwrap.dedent(SUITE))
    run = tmp_path / "run"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "harness.commands.rerun",
            "--sglang",
            str(tree),
            "--changed",
            "HEAD",
            "--suites-dir",
            str(suites),
            "test_changed_tail.py",
            "--run-dir",
            str(run),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    summary = json.loads((run / "report" / "summary.json").read_text())["coverage"]
    rows = {r["function"]: r for r in summary["functions"]}
    tail, prealloc = rows["DecodePreallocQueue._swa_tail_len"], rows["alloc_for_decode_prealloc_hisparse"]
    assert tail["changed"] == tail["executed"] and len(tail["changed"]) == 2
    assert any(t.endswith("test_changed_tail.py::test_tail_of_a_window") for t in tail["tests"]), tail["tests"]
    assert prealloc["executed"] == [] and len(prealloc["never"]) == 2
    assert summary["base"] == "HEAD" and summary["not_measured"] == []
    assert "changed lines executed: 2 of 4" in done.stdout
    md = (run / "report" / "summary.md").read_text()
    assert "| sglang/srt/disaggregation/decode.py | alloc_for_decode_prealloc_hisparse | 0 of 2 |" in md
    assert "Changed lines of sglang (vs HEAD)" in (run / "report" / "index.html").read_text()
