"""Mutation score (:mod:`harness.mutation`, ``harness mutate``).

The operator tests read mutants of a small function. The run test is the mutation smoke of
``.ci/run``: ``harness mutate --changed HEAD`` on a git checkout holding a link tree of the installed
sglang whose ``DecodePreallocQueue._swa_tail_len`` was edited on two lines, with two candidate tests of
its own: one pins the value of the early return, the other only checks that the window path returns an
int. The early return's mutants must be killed by the first test (named, with its evidence), the
window path's must survive: a mutant no test can tell from the original is reported as surviving.
Six mutants (``--limit``, spread over the operators): the smoke stays under a minute.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from harness.mutation import operators, select

REPO = Path(__file__).resolve().parent.parent

SOURCE = '''
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
'''


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
EDITS = (("            return max(seq_len, 0)\n", "            return max(0, seq_len)\n"),
         ("        window_start = (window_start // page_size) * page_size\n        return seq_len - window_start\n",
          "        aligned = (window_start // page_size) * page_size\n        return seq_len - aligned\n"))

CANDIDATES = '''
import types

import pytest

from harness.targets.sglang import runtime


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

    runtime.publish(runtime.RuntimeSettings())
    assert isinstance(DecodePreallocQueue._swa_tail_len(_queue(True), 300), int)
'''


def _git(root: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(root), "-c", "user.email=t@t", "-c", "user.name=t", *args], check=True,
                   capture_output=True)


@pytest.mark.est_time(50)
def test_mutate_kills_what_a_test_pins_and_reports_what_no_test_sees_as_surviving(tmp_path):
    installed = Path(__import__("importlib").util.find_spec("sglang").submodule_search_locations[0]).parent
    tree = tmp_path / "tree"
    rel = "sglang/srt/disaggregation/decode.py"
    shutil.copytree(installed / "sglang", tree / "sglang", copy_function=os.symlink)
    path = tree / rel
    text = path.read_text()
    path.unlink()
    path.write_text(text)
    (tree / ".gitignore").write_text("/sglang/\n")
    _git(tree, "init", "-q")
    _git(tree, "add", ".gitignore")
    _git(tree, "add", "-f", rel)
    _git(tree, "commit", "-qm", "the release's decode.py")
    for old, new in EDITS:
        assert text.count(old) == 1
        text = text.replace(old, new)
    path.write_text(text)
    for pyc in (path.parent / "__pycache__").glob("decode.*.pyc"):
        pyc.unlink()
    tests = tmp_path / "test_candidates.py"
    tests.write_text(textwrap.dedent(CANDIDATES))
    out = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "harness.cli", "mutate", "--sglang", str(tree), "--changed", "HEAD",
                           "--tests", str(tests), "--limit", "6", "--run-dir", str(out), "--comment-out", str(tmp_path / "status.md")],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    result = json.loads((out / "mutation.json").read_text())
    early = [m for m in result["mutants"] if m["line"] == text.splitlines().index("            return max(0, seq_len)") + 1]
    window = [m for m in result["mutants"] if m not in early]
    assert early and window and result["not_covered"] == 0
    for m in early:
        assert m["verdict"] == "killed", m
        assert m["killer"].endswith("test_candidates.py::test_early_return_pins_the_value") and m["oracle"] == "harness"
        assert m["evidence"].startswith("assertion"), m
    # Removing the assignment makes the next line raise NameError: a crash, which any test reaching it
    # sees; every other mutant of the window path keeps an int, which is all its test checks.
    crashed = [m for m in window if m["operator"] == "assign"]
    survived = [m for m in window if m["operator"] != "assign"]
    assert [m["verdict"] for m in crashed] == ["killed"] and crashed[0]["oracle"] == "crash"
    assert len(survived) == 3 and {m["operator"] for m in survived} == {"page", "arith", "align"}
    for m in survived:
        assert m["verdict"] == "survived" and m["fired"], m
        assert m["diff"].startswith(f"--- a/{rel}")
    assert result["score"] == round((len(early) + 1) / len(result["mutants"]), 4)
    window = survived
    md = (out / "mutation.md").read_text()
    assert f"#### Survivors ({len(window)})" in md
    assert "mutation score" in (tmp_path / "status.md").read_text()
