"""Each of sglang's own checks that the harness turns on really is on: a catalog fault trips it in a
real run and the failure's headline names the check (so the test fails if the harness stopped turning
the check on: nothing would raise it). The same fault with the harness's checks turned off must still
fail, by the harness's own oracle, and not in the check's name: the catalog counts the fault's catch,
not the check's alone.

Each run turns on only the check under test (and what sglang runs it inside, :data:`ALSO_ON`) and the
others off (``HARNESS_SGLANG_CHECKS=<name>``): the checks fire at different points of the same broken
release, and the first to fire would otherwise hide the others (the idle memory check, on in sglang by
default, fires at the servers' warm-up). The checks-off run (``HARNESS_SGLANG_CHECKS=0``) must still
fail, by the harness's own oracle: the ledger, or the suite's own greedy-consistency assertion,
catches the fault with sglang's checks off. The checks-off runs of one fault are one run of every
selection that fault trips (each test's failures read from its own JUnit cases).
The runs of this module start in order, two at a time (each is one pytest process), each test
waiting for its own.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Iterator

import pytest

from harness import topology
from harness.engines import fork_preload
from harness.engines.server import stack
from harness.targets.sglang import selection as target
from harness.targets.sglang.compat import checks

# pytest's 300 s per test is shorter than what a test may wait here: its run starts only when a place of
# AT_ONCE frees up, after the runs before it (the last test waited past 300 s on a loaded 2-core machine).
# Each wait has its own bound, RUN_TIMEOUT_S, so the test's timeout is that bound.
RUN_TIMEOUT_S = 900
pytestmark = [pytest.mark.est_time(100), pytest.mark.timeout(RUN_TIMEOUT_S + 60)]

REPO = Path(__file__).resolve().parent.parent
# A simulated PD request's release on the decode rank (sglang's release_kv_cache on real SWA pools).
SIM_RELEASE = "suites/disaggregation/test_disaggregation_basic.py::test_mixed_prompt_lengths_around_page_boundaries"
# A real plain server of the SWA model serving several requests in a row: sglang 0.5.23 runs its busy
# memory check only in the plain scheduler loops (event_loop_normal / _overlap), never in the PD ones;
# its idle check fires at the server's warm-up, whose request already leaks. Plain and PD servers get
# sglang's checks from the same command builder (launcher.server_command, every role), so a plain
# server is enough to show them on, without the three processes of a PD stack.
PLAIN = "suites/disaggregation/test_disaggregation_swa_server.py::test_patched_plain_server_is_consistent"

#: check -> (the selection, the fault that trips it there, what the headline then names)
TRIPS: dict[str, tuple[str, str, str]] = {
    "invariant-strict": (SIM_RELEASE, "release-leaks-swa", "[invariant-strict: swa.peer_released]"),
    "mem-check-busy": (PLAIN, "release-leaks-swa", "[mem-check-busy: SWA]"),
    "mem-check-idle": (PLAIN, "release-leaks-swa", "[mem-check-idle: pool]"),
    # A page handed out but left in the free list: every count balances, so only page-level checks see it.
    "kv-page-invariants": (PLAIN, "extend-keeps-pages-it-hands-out", "[kv-page-invariants: use-after-free]"),
    "debug-memory-pool": (PLAIN, "extend-keeps-pages-it-hands-out", "[debug-memory-pool: no_duplicate_pages]"),
}

#: check -> the checks it needs on beside it. sglang 0.5.23 runs its KV page invariants inside the busy
#: memory check, and raises their breaks only at the idle check's level (warning otherwise); neither of
#: those sees this fault (its counts balance), so the hit is the page invariants' own.
ALSO_ON: dict[str, tuple[str, ...]] = {"kv-page-invariants": ("mem-check-busy", "mem-check-idle")}


#: Runs alive at once: each starts a Ray cluster, and a server run three or four servers; more than
#: two on a 2-core runner only thrash (and slow every other test of the run beside them).
AT_ONCE = 2


class Run:
    """One ``pytest SELECTION... --inject-fault FAULT`` with the given checks selected (:meth:`start`)."""

    def __init__(self, selections: tuple[str, ...], fault: str, select: str, out: Path):
        servers = {s.split("::")[0].endswith("_server.py") for s in selections}
        self.engine = "all" if len(servers) > 1 else ("sglang-server" if servers == {True} else "sim")
        self.selections, self.fault, self.select, self.out = selections, fault, select, out
        self.junit = out / "junit.xml"
        self.log = out / "pytest.log"
        self.proc: subprocess.Popen | None = None

    def start(self, shared: dict[str, str]) -> None:
        self.out.mkdir(parents=True)
        env = {k: v for k, v in os.environ.items() if k not in (target.ENV_VAR, "HARNESS_FAULTS")}
        env.update({target.ENV_VAR: target.INSTALLED, checks.SELECT_ENV: self.select, **shared})
        # A fork of the Python preload (the third-party graph imported once per worker, not per run); the
        # ranks of the simulated run then fork from it too, the servers from this worker's server fork
        # server (``shared``), and the fault is applied by the run's plugin and the servers' sitecustomize.
        argv, env = fork_preload.python_command(
            [
                sys.executable,
                "-m",
                "pytest",
                "-p",
                "no:cacheprovider",
                "-q",
                "-n",
                "0",
                "--engine",
                self.engine,
                "--run-dir",
                str(self.out / "run"),
                "--inject-fault",
                self.fault,
                f"--junitxml={self.junit}",
                *self.selections,
            ],
            env,
        )
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)

    def messages(self, selection: str) -> list[str]:
        """The failure messages of ``selection``'s JUnit cases (the run has exited)."""
        assert self.junit.is_file(), self.log.read_text()[-3000:]
        name = selection.split("::")[-1]
        cases = [c for c in ET.parse(self.junit).getroot().iter("testcase") if c.get("name", "").split("[")[0] == name]
        assert cases, f"{selection} did not run: {self.log.read_text()[-3000:]}"
        return [f.get("message", "") for c in cases for f in c if f.tag in ("failure", "error")]


class Runs:
    """The module's runs, started in order, at most :data:`AT_ONCE` alive; :meth:`messages` waits for one."""

    def __init__(self, base: Path):
        self.base = base
        self.shared = stack.fork_server_env(topology.get("cpu"))
        self.runs: dict[tuple[str, str], Run] = {}
        # The checks-off runs first: each runs several selections in a row, the longest runs of the module.
        for fault in dict.fromkeys(fault for _, fault, _ in TRIPS.values()):
            selections = tuple(dict.fromkeys(sel for sel, f, _ in TRIPS.values() if f == fault))
            self.runs[(fault, "0")] = Run(selections, fault, "0", base / f"run{len(self.runs)}-off")
        for name, (selection, fault, _) in TRIPS.items():
            select = ",".join((name, *ALSO_ON.get(name, ())))
            self.runs[(fault, name)] = Run((selection,), fault, select, base / f"run{len(self.runs)}-{name}")
        self._top_up()

    def _top_up(self) -> None:
        alive = [r for r in self.runs.values() if r.proc is not None and r.proc.poll() is None]
        for run in self.runs.values():
            if len(alive) >= AT_ONCE:
                break
            if run.proc is None:
                run.start(self.shared)
                alive.append(run)

    def messages(self, key: tuple[str, str], selection: str, timeout: float = RUN_TIMEOUT_S) -> list[str]:
        run = self.runs[key]
        deadline = time.monotonic() + timeout
        while run.proc is None or run.proc.poll() is None:
            assert time.monotonic() < deadline, f"{key} did not finish within {timeout:g} s: {run.log}"
            self._top_up()
            time.sleep(0.5)
        self._top_up()
        return run.messages(selection)

    def stop(self) -> None:
        for run in self.runs.values():
            if run.proc is not None and run.proc.poll() is None:
                run.proc.kill()
                run.proc.wait()


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Runs]:
    """Every run of the module, keyed by (fault, checks selected): one per check, and one checks-off
    run per fault of every selection it trips."""
    started = Runs(tmp_path_factory.mktemp("trips"))
    yield started
    started.stop()


@pytest.mark.parametrize("check", sorted(TRIPS))
def test_the_check_is_on_and_its_hit_names_it(runs, check):
    selection, fault, names = TRIPS[check]
    on = runs.messages((fault, check), selection)
    assert on, f"{fault} failed no test with {check} on"
    assert any(names in m for m in on), f"no failure names {names}: {on}"
    off = runs.messages((fault, "0"), selection)
    assert off, f"{fault} failed no test with sglang's checks off: the harness's own oracle must catch it too"
    assert not any(names in m for m in off), f"with the checks off a failure still names {names}: {off}"
