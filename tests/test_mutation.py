"""Mutation score (:mod:`harness.mutation`, ``harness mutate``).

The operator tests read mutants of a small function. The run test is the mutation smoke of
``.ci/run``: ``harness mutate --changed HEAD --compare-upstream`` on a checkout-shaped git repository
(``python/sglang``: a link tree of the installed sglang whose ``DecodePreallocQueue._swa_tail_len`` was
edited on two lines; ``test/registered/``: sglang-style unit tests) with two candidate tests of its own:
one pins the value of the early return, the other only checks that the window path returns an int.
The early return's mutants must be killed by the first test (named, with its evidence), the window
path's must survive: a mutant no test can tell from the original is reported as surviving. The
upstream side runs only the CPU-registered file (the weak one), which kills none. Four mutants
(``--limit``, spread over the operators): the smoke stays near a minute.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import pr_checkout
from harness.mutation import operators, run, select
from harness.rerun import checkpoint

REPO = Path(__file__).resolve().parent.parent

SOURCE = """
def tail(seq_len, window, page_size):
    if seq_len <= 0:
        return max(seq_len, 0)
    start = max(0, seq_len - window)
    start = (start // page_size) * page_size
    return seq_len - start


class Pool:
    def free(self, pages):
        self.release(pages)
        self.count = self.count - len(pages)
"""


def test_operators_cover_the_engine_shapes_and_every_mutant_compiles_in_place():
    ms = operators.mutants_of(SOURCE, "sglang/x.py", "tail")
    by_op = {m.operator for m in ms}
    assert {"compare", "minmax", "number", "arith", "align", "page", "assign"} <= by_op
    align = [m for m in ms if m.operator == "align"]
    assert [m.new for m in align] == ["-(-(start) // page_size) * page_size"]
    lines = SOURCE.count("\n")
    for m in ms:
        for marker in (True, False):
            text = operators.mutate_source(SOURCE, m, marker=marker)
            ast.parse(text)
            assert text.count("\n") == lines, m  # every other line keeps its number
    marked = operators.mutate_source(SOURCE, align[0])
    assert f"__import__('{operators.MARKER_MODULE}').hit('{align[0].id}'" in marked
    # A removed call or assignment in a method; the page operator needs a page size to read.
    pool = operators.mutants_of(SOURCE, "sglang/x.py", "Pool.free")
    assert {m.operator for m in pool} >= {"call", "assign", "arith"} and "page" not in {m.operator for m in pool}
    with pytest.raises(LookupError, match="no function nope"):
        operators.mutants_of(SOURCE, "sglang/x.py", "nope")


def test_a_limit_spreads_over_functions_and_operators(tmp_path):
    (tmp_path / "sglang").mkdir()
    (tmp_path / "sglang" / "x.py").write_text(SOURCE)
    funcs = select.named(["sglang.x:tail", "sglang.x:Pool.free"], tmp_path)
    chosen = select.mutants(funcs, tmp_path, limit=4)
    assert [m.function for m in chosen] == ["tail", "Pool.free", "tail", "Pool.free"]
    assert len({m.operator for m in chosen if m.function == "tail"}) == 2
    with pytest.raises(select.SelectError, match="has no function"):
        select.named(["sglang.x:Pool.nope"], tmp_path)
    with pytest.raises(select.SelectError, match="MODULE:QUALNAME"):
        select.named(["tail"], tmp_path)


# The edit a PR makes (behaviour unchanged): the early return and the page floor, rewritten.
EDITS = (
    ("            return max(seq_len, 0)\n", "            return max(0, seq_len)\n"),
    (
        "        window_start = (window_start // page_size) * page_size\n        return seq_len - window_start\n",
        "        aligned = (window_start // page_size) * page_size\n        return seq_len - aligned\n",
    ),
)

CANDIDATES = """
import types

import pytest

from harness.engines.sim import rank_runtime


def _queue(swa):
    return types.SimpleNamespace(_uses_swa_tail_prealloc=lambda: swa,
                                 scheduler=types.SimpleNamespace(sliding_window_size=100),
                                 token_to_kv_pool_allocator=types.SimpleNamespace(page_size=64))


def test_early_return_pins_the_value():
    from sglang.srt.disaggregation.decode import DecodePreallocQueue

    assert DecodePreallocQueue._swa_tail_len(_queue(False), -5) == 0
    assert DecodePreallocQueue._swa_tail_len(_queue(False), 7) == 7


def test_window_path_returns_an_int():
    from sglang.srt.disaggregation.decode import DecodePreallocQueue

    rank_runtime.publish(rank_runtime.RuntimeSettings())
    assert isinstance(DecodePreallocQueue._swa_tail_len(_queue(True), 300), int)
"""


UPSTREAM = {
    # CPU-registered, imports the module, checks almost nothing: kills no mutant here.
    "unit/test_tail_registered.py": """
        import unittest

        from sglang.srt.disaggregation.decode import DecodePreallocQueue
        from sglang.test.ci.ci_register import register_cpu_ci

        register_cpu_ci(est_time=5, suite="stage-a-test-cpu")


        class TestTail(unittest.TestCase):
            def test_has_the_method(self):
                self.assertTrue(callable(DecodePreallocQueue._swa_tail_len))
        """,
    # Not registered for CPU CI (a CUDA file): left out, though it would fail every mutant.
    "unit/test_tail_cuda_only.py": """
        import unittest

        from sglang.srt.disaggregation.decode import DecodePreallocQueue
        from sglang.test.ci.ci_register import register_cuda_ci

        register_cuda_ci(est_time=5, suite="stage-b-test-1-gpu")


        class TestTail(unittest.TestCase):
            def test_always_fails(self):
                self.fail("a CUDA-only file must not run")
        """,
}


def test_compare_upstream_needs_a_checkout(tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "harness.cli",
            "mutate",
            "--compare-upstream",
            "--limit",
            "1",
            "--run-dir",
            str(tmp_path / "run"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2 and "has no test/registered/" in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and not (tmp_path / "run").exists()


@pytest.mark.est_time(60)
def test_mutate_kills_what_a_test_pins_and_reports_what_no_test_sees_as_surviving(tmp_path):
    tree, text = pr_checkout.make(
        tmp_path / "repo", EDITS, {f"test/registered/{name}": body for name, body in UPSTREAM.items()}
    )
    rel = pr_checkout.DECODE
    tests = tmp_path / "test_candidates.py"
    tests.write_text(textwrap.dedent(CANDIDATES))
    out, bg, status_file = tmp_path / "run", tmp_path / "mutate-bg", tmp_path / "status.md"
    # As the bot's run job does (--mutate-detached): the run goes on in the background and each checkpoint hands
    # out the status file when it changed; the progress line must show up at a checkpoint before the score.
    argv = [
        sys.executable,
        "-m",
        "harness.cli",
        "mutate",
        "--sglang",
        str(tree),
        "--changed",
        "HEAD",
        "--tests",
        str(tests),
        "--limit",
        "4",
        "--compare-upstream",
        "--run-dir",
        str(out),
        "--comment-out",
        str(status_file),
    ]
    assert checkpoint.start(bg, argv, cwd=REPO) > 0
    handed_out = []
    for _ in range(200):  # 200 checkpoints of at most 3 s: the run's 600 s bound
        running, changed = checkpoint.wait(bg, status_file, 3.0)
        if changed:
            handed_out.append(status_file.read_text())
        if not running:
            break
    code = checkpoint.finish(bg)
    log = (bg / "log").read_text()
    assert code == 0, log[-5000:]
    assert any(re.search(r"mutation: \d / 4 mutants run", t) for t in handed_out[:-1]), handed_out
    assert "mutation score" in handed_out[-1]
    result = json.loads((out / "mutation.json").read_text())
    early_line = text.splitlines().index("            return max(0, seq_len)") + 1
    early = [m for m in result["mutants"] if m["line"] == early_line]
    window = [m for m in result["mutants"] if m["line"] != early_line]
    assert len(early) == 2 and len(window) == 2 and result["not_covered"] == 0
    for m in early:
        assert m["verdict"] == "killed", m
        assert m["killer"].endswith("test_candidates.py::test_early_return_pins_the_value") and m["oracle"] == "harness"
        assert m["evidence"].startswith("assertion"), m
    # Removing the assignment makes the next line raise NameError: a crash, which any test reaching it
    # sees; the page mutant of the window path keeps an int, which is all its test checks.
    by_op = {m["operator"]: m for m in window}
    assert by_op["assign"]["verdict"] == "killed" and by_op["assign"]["oracle"] == "crash"
    survivor = by_op["page"]
    assert survivor["verdict"] == "survived" and survivor["fired"], survivor
    assert survivor["diff"].startswith(f"--- a/{rel}")
    assert result["score"] == 0.75
    md = (out / "mutation.md").read_text()
    assert "#### Survivors (1)" in md
    status = (tmp_path / "status.md").read_text()
    assert "mutation score" in status and f"survived: {survivor['id']} (diffs in the report)" in status
    # sglang's own side: only the CPU-registered file ran (the CUDA one would have failed every mutant).
    theirs = result["upstream"]
    assert [Path(f).name for f in theirs["files"]] == ["test_tail_registered.py"]
    assert theirs["killed"] == 0 and theirs["survived"] == 4 and theirs["score"] == 0.0
    assert "harness 0.75 vs sglang's register_cpu_ci unit tests 0.00" in log


AWKWARD = '''
class Cache:
    def evict(self, n, page_size):
        """A docstring with a line at column 0:
this one."""
        label = f'{n + 1} pages'
        sep = '\x0c'
        keep = n - page_size
        return keep, label, sep
'''


def test_mutants_of_awkward_sources_keep_their_place_and_compile_with_their_marker():
    # A method whose docstring has a column-0 line, an f-string with single quotes (the marker's own
    # quotes would break it on Python 3.11) and a form feed inside a string (str.splitlines splits
    # there, Python does not).
    ms = operators.mutants_of(AWKWARD, "sglang/y.py", "Cache.evict")
    keep = [m for m in ms if m.operator == "arith" and m.old == "n - page_size"]
    assert keep and keep[0].line == AWKWARD.split("\n").index("        keep = n - page_size") + 1
    assert not [m for m in ms if m.old in ("n + 1", "1")], "a mutant inside the f-string"
    for m in ms:
        ast.parse(operators.mutate_source(AWKWARD, m))
        assert operators.mutate_source(AWKWARD, m).count("\n") == AWKWARD.count("\n")


@pytest.mark.parametrize(
    "evidence, killer, oracle",
    [
        ("ledger [swa-tail-short] decode-0 prealloc of r1", "t::a", "harness"),
        ("assertion tail 44 != 108", "t::a", "harness"),
        ("sglang-check debug-memory-pool: Full Pool Mem Leak Detected! | at sglang/x.py", "t::a", "sglang"),
        ("sglang-assert AssertionError: swa_evicted_seqlen % page_size | at sglang/x.py:10", "t::a", "sglang"),
        ("sglang-assert NameError: name 'window_size' is not defined | at sglang/x.py:5", "t::a", "crash"),
        ("pytest exited 2 before any test failed", "(pytest run)", "crash"),
    ],
)
def test_who_caught_a_mutant(evidence, killer, oracle):
    m = operators.mutants_of(SOURCE, "sglang/x.py", "tail")[0]
    assert run.Verdict(m, run.KILLED, ("t::a",), killer, evidence, True).oracle == oracle
    assert run.Verdict(m, run.SURVIVED, ("t::a",), fired=True).oracle == ""
