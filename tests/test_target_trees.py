"""A sglang source tree is what runs: an edit a PR might make to a release's tree is caught by the
suites through ``rerun-test --sglang TREE``, and the untouched tree passes.

The tree is the venv's installed release unpacked into a directory as links to its files (cheap
enough for CI: nothing is downloaded or copied), byte-code caches included (still valid: the
sources are the same files, so an import compiles nothing), with the one edited file a real file
whose cached byte-code is dropped.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from harness.targets.sglang import target

REPO = Path(__file__).resolve().parent.parent
SUITE = "test_swa_prealloc_accounting.py"
# The page floor of the SWA window start in DecodePreallocQueue._swa_tail_len (sglang#35286 / #35396).
PAGE_FLOOR = "        window_start = (window_start // page_size) * page_size\n"


def unpack_release(dest: Path) -> Path:
    """The installed sglang as a source tree at ``dest`` (every file a link to the release's file)."""
    installed = Path(target.resolve("installed").root)
    shutil.copytree(installed / "sglang", dest / "sglang", copy_function=os.symlink)
    for info in installed.glob("sglang-*.dist-info"):
        shutil.copytree(info, dest / info.name)
    return dest


def edit(tree: Path, rel: str, old: str, new: str) -> None:
    """Replace ``old`` (exactly once) in a tree's file, turning its link into a real file."""
    path = tree / rel
    text = path.read_text()
    assert text.count(old) == 1, f"{rel}: the text to edit is not there exactly once"
    path.unlink()
    path.write_text(text.replace(old, new))
    for pyc in (path.parent / "__pycache__").glob(f"{path.stem}.*.pyc"):
        pyc.unlink()  # a link to the release's byte-code of the file before the edit


def rerun(tree: Path, run_dir: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in (target.ENV_VAR, "HARNESS_FAULTS")}
    return subprocess.run([str(Path(sys.executable).parent / "rerun-test"), "--sglang", str(tree), "--run-dir",
                           str(run_dir), SUITE], cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)


@pytest.mark.timeout(2400)
def test_a_tree_without_the_page_floor_fails_naming_the_invariant_and_the_untouched_tree_passes(tmp_path):
    untouched = unpack_release(tmp_path / "release")
    broken = unpack_release(tmp_path / "pr")
    edit(broken, "sglang/srt/disaggregation/decode.py", PAGE_FLOOR, "")

    bad = rerun(broken, tmp_path / "run-pr")
    assert bad.returncode == 1, bad.stdout[-3000:] + bad.stderr[-2000:]
    assert f"(tree {broken.resolve()})" in bad.stdout, "the run names the tree it tested"
    failures = [ln for ln in bad.stdout.splitlines() if ln.startswith("FAILED ")]
    assert any("is not a multiple of page" in ln for ln in failures), failures

    good = rerun(untouched, tmp_path / "run-release")
    assert good.returncode == 0, good.stdout[-3000:] + good.stderr[-2000:]
    assert "passed" in good.stdout and not [ln for ln in good.stdout.splitlines() if ln.startswith("FAILED ")]


@pytest.mark.timeout(1800)
def test_an_older_release_installs_on_demand_and_runs_the_suites(tmp_path):
    # The CI-sized check that releases install from the package index on first use (into .venv's
    # cache, reused by later runs) and that the suites then run on them: one older release, one file.
    env = {k: v for k, v in os.environ.items() if k not in (target.ENV_VAR, "HARNESS_FAULTS")}
    run_dir = tmp_path / "run"
    done = subprocess.run([str(Path(sys.executable).parent / "rerun-test"), "--sglang", "0.5.22", "--run-dir",
                           str(run_dir), "test_decode_reservation.py"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=1500)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    import json

    summary = json.loads((run_dir / "report" / "summary.json").read_text())
    assert (summary["sglang"]["origin"], summary["sglang"]["version"]) == ("release", "0.5.22")
    assert Path(summary["sglang"]["root"]).resolve() == (target.cache_dir() / "0.5.22").resolve()
    junit = (run_dir / "report" / "junit.xml").read_text()
    assert 'name="sglang_version" value="0.5.22"' in junit
    assert sum(g["counts"]["passed"] for g in summary["groups"]) >= 1
