"""A sglang source tree is what runs: an edit a PR might make to a release's tree is caught by the
suites through ``rerun-test --sglang TREE``, every failure's first line says what caught it and where to
look, and the untouched tree passes.

The planted bug: ``DecodePreallocQueue._swa_tail_len`` rounds the window start up to a page instead of
down, so the tail it returns is one page short but still page-aligned (sglang's own asserts stay
quiet). One simulated PD test (2-gpu-h100, simulated) and one of the real-server suite's (a real
prefill + decode + router stack of the SWA model on ``cpu``) run on the tree.

The tree is the venv's installed release unpacked into a directory as links to its files (cheap
enough for CI: nothing is downloaded or copied), byte-code caches included (still valid: the
sources are the same files, so an import compiles nothing), with the one edited file a real file
whose cached byte-code is dropped. The module's runs start together (each is one process
importing sglang on one core), each test waiting for its own.
"""

from __future__ import annotations

import html
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

from harness.targets.sglang import selection as target

pytestmark = pytest.mark.est_time(90)

REPO = Path(__file__).resolve().parent.parent
SUITE = "test_swa_prealloc_accounting.py"
# The page floor of the SWA window start in DecodePreallocQueue._swa_tail_len (sglang#35286 / #35396),
# and the planted bug: the start rounded up, the tail one page short.
PAGE_FLOOR = "        window_start = (window_start // page_size) * page_size\n"
ONE_PAGE_SHORT = "        window_start = -(-window_start // page_size) * page_size\n"
PLANTED_SPECS = (
    "test_disaggregation_basic.py::test_mixed_prompt_lengths_around_page_boundaries",
    "test_disaggregation_swa_server.py::test_decode_ledger_holds_swa_invariants",
)
EVIDENCE = (
    "ledger",
    "kv",
    "sglang-check",
    "worker-death",
    "timeout",
    "sglang-assert",
    "prealloc",
    "assertion",
    "error",
)


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


OLDER = "0.5.22"


class Rerun:
    """One ``rerun-test --sglang TARGET SPEC`` started; :meth:`result` waits for it."""

    def __init__(self, target_spec: str, specs: tuple[str, ...], run_dir: Path, tree: Path | None = None):
        self.run_dir = run_dir
        self.tree = tree
        env = {k: v for k, v in os.environ.items() if k not in (target.ENV_VAR, "HARNESS_FAULTS")}
        # Output to files, not pipes: a run nobody reads yet must not block on a full pipe.
        self.out, self.err = run_dir.with_name("stdout.log"), run_dir.with_name("stderr.log")
        with open(self.out, "wb") as out, open(self.err, "wb") as err:
            self.proc = subprocess.Popen(
                [
                    str(Path(sys.executable).parent / "rerun-test"),
                    "--sglang",
                    target_spec,
                    "--run-dir",
                    str(run_dir),
                    *specs,
                ],
                cwd=REPO,
                env=env,
                stdout=out,
                stderr=err,
            )
        self._done: subprocess.CompletedProcess | None = None

    def result(self) -> subprocess.CompletedProcess:
        if self._done is None:
            try:
                self.proc.wait(timeout=1500)
            finally:
                self.stop()
            self._done = subprocess.CompletedProcess(
                self.proc.args,
                self.proc.returncode,
                self.out.read_text(errors="replace"),
                self.err.read_text(errors="replace"),
            )
        return self._done

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


#: The runs each test needs (started together by the ``reruns`` fixture).
NEEDS = {
    "test_a_tree_with_the_tail_one_page_short_fails_naming_rule_request_and_suspect": ("pr", "release"),
    "test_an_older_release_installs_on_demand_and_runs_the_suites": (OLDER,),
}


@pytest.fixture(scope="module")
def reruns(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Rerun]]:
    """The rerun-test runs the module's selected tests need, all started at once (each group is one
    pytest process importing sglang on one core; the machine has more), each test waiting for its own."""
    wanted = [
        name
        for item in request.session.items
        if item.module is request.module
        for name in NEEDS.get(getattr(item, "originalname", item.name), ())
    ]
    runs: dict[str, Rerun] = {}
    try:
        for name in dict.fromkeys(wanted):
            base = tmp_path_factory.mktemp(name)
            if name == OLDER:
                runs[name] = Rerun(OLDER, ("test_decode_reservation.py",), base / "run")
                continue
            tree = unpack_release(base / name)
            if name == "pr":
                edit(tree, "sglang/srt/disaggregation/decode.py", PAGE_FLOOR, ONE_PAGE_SHORT)
            runs[name] = Rerun(str(tree), PLANTED_SPECS if name == "pr" else (SUITE,), base / "run", tree)
        yield runs
    finally:
        for run in runs.values():
            run.stop()


@pytest.mark.timeout(2400)
def test_a_tree_with_the_tail_one_page_short_fails_naming_rule_request_and_suspect(reruns):
    broken = reruns["pr"].tree
    bad, good = reruns["pr"].result(), reruns["release"].result()
    assert bad.returncode == 1, bad.stdout[-3000:] + bad.stderr[-2000:]
    assert f"(tree {broken.resolve()})" in bad.stdout, "the run names the tree it tested"
    failures = [ln for ln in bad.stdout.splitlines() if ln.startswith("FAILED ")]
    assert failures, bad.stdout[-3000:]
    # Every failure's first line names its evidence class; none is Ray's wrapper or cut before its cause.
    heads = [ln.split("): ", 1)[1] for ln in failures]
    assert all(h.split(" ", 1)[0] in EVIDENCE for h in heads), heads
    assert not [h for h in heads if "ray::" in h or "repr=<" in h or "\x1b[" in h], heads
    suspect = "suspect: sglang/srt/disaggregation/decode.py DecodePreallocQueue._swa_tail_len"
    tail_short = [h for h in heads if h.startswith("ledger [swa-tail-short] ") and suspect in h]
    assert tail_short, heads
    simulated = [ln for ln in failures if "test_disaggregation_basic.py::" in ln and "(2-gpu-h100)" in ln]
    served = [ln for ln in failures if "_server.py::" in ln and "(cpu)" in ln]
    assert simulated and served, "the planted bug fails the simulated suite and the real-server suite"
    for ln in simulated + served:  # both lead with the rule the bug breaks, and name the request
        head = ln.split("): ", 1)[1]
        assert head.startswith("ledger [swa-tail-short] ") and " prealloc of " in head and suspect in head, ln
    # The same lines in summary.md (what the /rerun-test comment links) and on the report page.
    summary = (reruns["pr"].run_dir / "report" / "summary.md").read_text()
    page = (reruns["pr"].run_dir / "report" / "index.html").read_text()
    for head in heads:
        assert head in summary, head
        assert html.escape(head[:120], quote=True) in page or html.escape(head[:120]) in page, head

    assert good.returncode == 0, good.stdout[-3000:] + good.stderr[-2000:]
    assert "passed" in good.stdout and not [ln for ln in good.stdout.splitlines() if ln.startswith("FAILED ")]


@pytest.mark.timeout(1800)
def test_an_older_release_installs_on_demand_and_runs_the_suites(reruns):
    # The CI-sized check that releases install from the package index on first use (into .venv's
    # cache, reused by later runs) and that the suites then run on them: one older release, one file.
    run = reruns[OLDER]
    done = run.result()
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    import json

    summary = json.loads((run.run_dir / "report" / "summary.json").read_text())
    assert (summary["sglang"]["origin"], summary["sglang"]["version"]) == ("release", OLDER)
    assert Path(summary["sglang"]["root"]).resolve() == (target.cache_dir() / OLDER).resolve()
    junit = (run.run_dir / "report" / "junit.xml").read_text()
    assert f'name="sglang_version" value="{OLDER}"' in junit
    assert sum(g["counts"]["passed"] for g in summary["groups"]) >= 1
