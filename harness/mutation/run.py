"""Running mutants: the coverage map that selects each mutant's tests, one pytest run per mutant, the
verdicts.

A mutant runs as a fault does: a scratch copy of the target with the one file mutated, first on every
process's import path, its pytest run forked from the third-party preload and stopped at the first
failure. Verdicts: ``killed``, ``survived``, ``timeout``, ``not covered``. How, and each verdict's rule:
docs/modules.md.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from harness.changes.lines import statement_starts
from harness.changes.measure import Combined, Measurement
from harness.faults import source
from harness.mutation.operators import MARKER_MODULE, MARKER_SOURCE, Mutant, mutate_source
from harness.report import junit
from harness.engines import fork_preload
from harness.targets.sglang.selection import OVERLAY_ENV
from harness.workers import childpytest, procs

log = logging.getLogger(__name__)

KILLED, SURVIVED, TIMEOUT, NOT_COVERED = "killed", "survived", "timeout", "not covered"
#: The evidence classes of sglang's own checks (the rest are the harness's oracle: ledger, kv, assertion, ...).
SGLANG_CLASSES = ("sglang-assert", "sglang-check")


@dataclass
class Verdict:
    """What became of one mutant."""

    mutant: Mutant
    verdict: str
    tests: tuple[str, ...] = ()
    killer: str = ""
    evidence: str = ""
    fired: bool = False
    seconds: float = 0.0

    @property
    def oracle(self) -> str:
        """Who caught it: ``harness`` (the harness's oracle: ledger, KV, a named assertion), ``sglang``
        (sglang's own assert or check), ``crash`` (the mutant made sglang raise something else, such as
        a NameError: any test reaching it kills it); ``""`` when not killed."""
        if self.verdict != KILLED:
            return ""
        if self.evidence.startswith("sglang-check"):
            return "sglang"
        if not self.evidence.startswith(SGLANG_CLASSES):
            return "crash" if self.killer == "(pytest run)" else "harness"
        return "sglang" if "AssertionError" in self.evidence else "crash"


@dataclass
class CoverageMap:
    """Which candidate tests reach which lines of the target (one measured run of all of them)."""

    combined: Combined
    candidates: tuple[str, ...]
    wall_s: float = 0.0
    #: Each test's time in the map run: a mutant's tests run fastest first, so a kill comes soonest.
    durations: dict[str, float] = field(default_factory=dict)
    #: ``sglang/...`` -> its lines' statement starts (coverage names a statement by its first line).
    starts: dict[str, dict[int, int]] = field(default_factory=dict)

    @property
    def tests_seen(self) -> set[str]:
        return set(self.durations)

    def tests_for(self, m: Mutant, tree: Path) -> tuple[str, ...]:
        """The tests whose context reached ``m``'s statements, fastest first; every candidate when a line
        was run only by a process a test started (a Ray worker, a server: its context names no test)."""
        ran = self.combined.lines.get(m.path, {})
        if m.path not in self.starts:
            self.starts[m.path] = statement_starts((tree / m.path).read_text(encoding="utf-8"))
        starts = self.starts[m.path]
        contexts: set[str] = set()
        for line in {starts.get(n, n) for n in range(m.line, m.end_line + 1)}:
            contexts |= ran.get(line, set())
        tests = {c.partition("|")[2] for c in contexts}
        if "" in tests:
            return self.candidates
        return tuple(sorted(tests, key=lambda t: (self.durations.get(t, 0.0), t)))


def pytest_command(tests: Sequence[str], junit_path: Path, run_dir: Path, *, first_failure: bool = True) -> list[str]:
    """The pytest command of a map, mutant or clean run (``first_failure``: stop at the first failure)."""
    return childpytest.command(
        tests,
        junit=junit_path,
        run_dir=run_dir,
        before=[*(["-x"] if first_failure else []), "-q", "-p", "no:cacheprovider", "-p", "no:xdist"],
    )


def coverage_map(candidates: Sequence[str], out: Path, root: Path, tree: Path, timeout_s: float) -> CoverageMap:
    """Run ``candidates`` once on the unmutated target, measured, and read back which tests ran what.

    Raises:
        RuntimeError: the unmutated run failed (a mutant's failure would mean nothing).
    """
    measure = Measurement(out / "coverage", tree)
    junit_path = out / "map.xml"
    env = childpytest.environment(measure.env("map"))
    start = time.monotonic()
    code, timed_out = procs.run_logged(
        pytest_command(candidates, junit_path, out / "pytest" / "map"),
        cwd=root,
        env=env,
        log=out / "map.log",
        timeout_s=timeout_s,
    )
    if code != 0 or timed_out:
        raise RuntimeError(
            f"the candidate tests fail on the unmutated target (exit {code}"
            f"{', timed out' if timed_out else ''}); see {out / 'map.log'}"
        )
    times = {c.nodeid: c.duration for c in junit.read_junit(junit_path, root)} if junit_path.exists() else {}
    return CoverageMap(measure.combine(), tuple(candidates), time.monotonic() - start, times)


def run_mutant(m: Mutant, tests: Sequence[str], out: Path, root: Path, tree: Path, timeout_s: float) -> Verdict:
    """Run ``tests`` against mutant ``m`` (see the module docstring)."""
    if not tests:
        return Verdict(m, NOT_COVERED)
    label = m.id.replace(":", "-").replace(".", "_").replace("<", "").replace(">", "")
    scratch = Path(tempfile.mkdtemp(prefix="harness-mutant-"))
    try:
        text = mutate_source((tree / m.path).read_text(encoding="utf-8"), m)
        source.scratch_files({m.path: text}, scratch, tree, [f"mutant {m.id}"])
        (scratch / f"{MARKER_MODULE}.py").write_text(MARKER_SOURCE, encoding="utf-8")
        fired_file = scratch / "fired.txt"
        # The copy goes first through the overlay alone: the run's target plugin puts it first on
        # sys.path and PYTHONPATH (for everything the tests start). PYTHONPATH is left as it is, so
        # every mutant forks from one fork server (a preload read PYTHONPATH: a new value, a new server).
        env = childpytest.environment({OVERLAY_ENV: str(scratch), source.FIRED_ENV: str(fired_file)})
        junit_path = out / "junit" / f"{label}.xml"
        junit_path.parent.mkdir(parents=True, exist_ok=True)
        (out / "logs").mkdir(exist_ok=True)
        argv, env = fork_preload.python_command(pytest_command(tests, junit_path, out / "pytest" / label), env)
        start = time.monotonic()
        code, timed_out = procs.run_logged(
            argv, cwd=root, env=env, log=out / "logs" / f"{label}.log", timeout_s=timeout_s
        )
        seconds = time.monotonic() - start
        fired = m.id in source.fired(fired_file)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if timed_out:
        return Verdict(m, TIMEOUT, tuple(tests), fired=fired, seconds=seconds)
    try:
        cases = junit.read_junit(junit_path, root) if junit_path.exists() else []
    except ValueError:  # a report cut short (the run died writing it): judged by its exit status below
        cases = []
    failed = [c for c in cases if c.outcome in ("failed", "error")]
    if failed:
        first = failed[0]
        killer, evidence = first.nodeid, (first.message or first.outcome).splitlines()[0][:300]
    elif code not in (0, 5):  # pytest itself failed (collection, a crash) before any test did
        killer, evidence = "(pytest run)", f"pytest exited {code} before any test failed; see logs/{label}.log"
    else:
        return Verdict(m, SURVIVED, tuple(tests), fired=fired, seconds=seconds)
    if not fired:
        # The tests failed with the original code running (the mutant's marker never ran): a flaky or
        # broken test, not a catch. The mutant counts as surviving; the failure is kept as evidence.
        return Verdict(
            m, SURVIVED, tuple(tests), killer, f"failed without the mutant running: {evidence}", fired, seconds
        )
    return Verdict(m, KILLED, tuple(tests), killer, evidence, fired, seconds)


def run_all(
    mutants: Sequence[Mutant],
    cmap: CoverageMap,
    out: Path,
    root: Path,
    tree: Path,
    *,
    jobs: int,
    timeout_s: float,
    on_done: Callable[[Verdict, int, int], None] = lambda v, d, n: None,
) -> list[Verdict]:
    """Every mutant, ``jobs`` at a time; ``on_done(verdict, done, total)`` after each."""
    return in_pool(
        [(m, cmap.tests_for(m, tree)) for m in mutants],
        out,
        root,
        tree,
        jobs=jobs,
        timeout_s=timeout_s,
        on_done=on_done,
    )


def in_pool(
    work: Sequence[tuple[Mutant, Sequence[str]]],
    out: Path,
    root: Path,
    tree: Path,
    *,
    jobs: int,
    timeout_s: float,
    on_done: Callable[[Verdict, int, int], None],
) -> list[Verdict]:
    """Run each ``(mutant, tests)``, ``jobs`` at a time, verdicts in ``work``'s order. An interrupt or
    a failure of the harness itself cancels what has not started and raises (as :class:`MutationError`,
    naming the mutant, for a failure)."""
    verdicts: list[Verdict | None] = [None] * len(work)
    pool = ThreadPoolExecutor(max_workers=max(1, jobs))
    try:
        futures = {
            pool.submit(run_mutant, m, tests, out, root, tree, timeout_s): i for i, (m, tests) in enumerate(work)
        }
        for done, fut in enumerate(as_completed(futures), 1):
            i = futures[fut]
            try:
                verdicts[i] = fut.result()
            except Exception as exc:
                raise MutationError(f"mutant {work[i][0].id}: the harness failed running it: {exc!r}") from exc
            on_done(verdicts[i], done, len(work))  # type: ignore[arg-type]
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    return [v for v in verdicts if v is not None]


class MutationError(RuntimeError):
    """The harness (not a mutant) failed during a mutation run: one line naming the mutant."""
