"""The Hypothesis state machine over one in-process PD pair, the exploration loop, and replay of what it found.

:class:`Session` runs batches of schedules (each batch one seeded Hypothesis run) until its examples or its
time are spent; a failing batch shrinks to a minimal schedule, which the session keeps as a :class:`Finding`
(the steps, the pools, the failure, the ledger events). :func:`write_repro` writes it to a file and
:func:`replay` runs such a file's steps again, exactly, without Hypothesis (:func:`shrink_by_replay` uses it
to shrink further). Over 400 lines: the rules, the loop and the replay read one recorded schedule format.
"""

from __future__ import annotations

import functools
import gc
import hashlib
import json
import re
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

from hypothesis import HealthCheck, Phase, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st
from hypothesis.errors import Flaky
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from harness.explore import inject
from harness.explore.pair import Pair, PairConfig, Step

#: The repro file's format version, and the kind ``rerun-test --from`` dispatches on (a gate's bundle has none).
REPRO_VERSION = 1
REPRO_KIND = "explore"
#: Schedules per Hypothesis run (a batch); the session runs batches until its budget is spent.
BATCH = 25
#: Most operations in one schedule.
MAX_STEPS = 40
#: A shrunk schedule longer than this gets a second pass (:func:`shrink_by_replay`).
SHORT = 10
#: Page sizes drawn (the first is what shrinking goes to; page 1 fails in the sim prefill side itself).
PAGE_SIZES = (16, 64)
#: The page size of DeepSeek-V4 hisparse pools (one schedule in four): its compressed C128 pool needs a
#: page of at least 128 tokens.
HISPARSE_PAGE = 256
#: Decode tokens a long request runs (``submit``'s second branch), and the most one ``decode`` step runs
#: to slide a window past a page (SWA eviction while decoding): a longer one is not drawn (too slow).
LONG_STEPS = 80


class BudgetSpent(BaseException):
    """The session's time ran out inside a batch. A ``BaseException``: Hypothesis counts an ``Exception`` as a
    failing schedule and shrinks it, this one it lets through at once (the machine's teardown still closes
    the pair).

    Hypothesis still closes the interrupted schedule in its tree of choice sequences, and when the schedule
    stopped where an earlier one of the batch (a mutation or shrink of it replays the same choices) drew on,
    that tree raises ``FlakyStrategyDefinition`` ("the second run stopped drawing earlier than the first run")
    in its place: :meth:`Session.run` reads that as this stop too (:attr:`Session.spent`)."""


@dataclass
class Finding:
    """A failing schedule, shrunk: what a repro file holds."""

    seed: int
    config: PairConfig
    steps: list[Step]
    failure: str
    at_end: bool  # broke in the end checks, after the last step
    log: list[str] = field(default_factory=list)
    faults: list[str] = field(default_factory=list)
    shrunk: bool = True  # False: the budget ran out while shrinking; the shortest failing schedule seen

    def lines(self) -> list[str]:
        """The schedule as numbered readable steps, the pools first and the failure last."""
        c = self.config
        out = [
            f"pools: page {c.page_size}, window {c.window}, full {c.full_pages} pages, swa {c.swa_pages} pages, "
            f"{c.req_slots} request slots, radix cache {'on' if c.radix_cache else 'off'}, "
            f"eviction interval {c.eviction_interval}, {c.chunk_pages} pages per chunk"
        ]
        out += [f"{i:>3}. {s.line()}" for i, s in enumerate(self.steps, 1)]
        if self.at_end:
            out.append(f"{len(self.steps) + 1:>3}. end: abort what is in flight, flush, check the baseline")
        out.append(f"  => {self.failure}")
        if not self.shrunk:
            out.append(
                "  (the budget ran out while Hypothesis shrank it: the shortest failing schedule seen, "
                f"shortened by replay when over {SHORT} steps)"
            )
        return out


@dataclass
class Progress:
    """What a session did so far."""

    schedules: int = 0
    steps: int = 0
    started: float = field(default_factory=time.perf_counter)
    rule_seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    rule_calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def slowest(self) -> tuple[str, float]:
        """The rule with the largest mean time (ms), or ``("", 0)`` before any."""
        if not self.rule_calls:
            return "", 0.0
        name = max(self.rule_calls, key=lambda r: self.rule_seconds[r] / self.rule_calls[r])
        return name, 1000 * self.rule_seconds[name] / self.rule_calls[name]

    def line(self) -> str:
        wall = time.perf_counter() - self.started
        name, ms = self.slowest()
        rate = self.steps / wall if wall else 0.0
        return (
            f"explore: {self.schedules} schedules, {self.steps} steps ({rate:.0f} steps/s) in {wall:.0f}s; "
            f"slowest rule {name or '-'} ({ms:.1f} ms)"
        )


@dataclass(frozen=True)
class Batch:
    """One Hypothesis run of a session: its seed, the schedules and steps it ran (shrinking included), and how
    it ended (``clean``, ``failure``, ``time, mid-batch``)."""

    seed: int
    schedules: int
    steps: int
    outcome: str


class Session:
    """One exploration: its seed, its budget, the run directory the ledgers go to, and what it found.

    Args:
        seed: the first batch's seed (batch i runs with ``seed + i``).
        run_dir: where the ranks write their ledgers (one file per rank, rewritten per schedule).
        examples: most schedules in all (None: no bound).
        seconds: time budget (None: no bound).
        faults: the faults active in this process (recorded in a repro).
        report: where progress lines go.
        clock: what the time budget is read from (tests pass one that jumps past it after N steps).

    The budget holds within a batch: every schedule's start and every step checks it, and a spent budget
    stops the batch at once (:class:`BudgetSpent`); :attr:`stopped` says why the session ended.
    """

    def __init__(
        self,
        seed: int,
        run_dir: Path,
        *,
        examples: int | None = None,
        seconds: float | None = None,
        faults: list[str] | None = None,
        report: Callable[[str], None] = lambda line: None,
        clock: Callable[[], float] = time.perf_counter,
    ):
        self.seed, self.run_dir, self.examples, self.seconds = seed, run_dir, examples, seconds
        self.clock = clock
        self.deadline = None if seconds is None else clock() + seconds
        self.stopped = ""  # why the session ended: "examples", "time", "time, mid-batch", "failure"
        self.best: Finding | None = None  # the shortest failing schedule seen (a stop while shrinking)
        self.batches: list[Batch] = []
        self.faults = list(faults or [])
        self.report = report
        self.progress = Progress()
        self.finding: Finding | None = None
        self.first_failure_s: float | None = None
        self.first_failure_at = (0, 0)  # schedules and steps run when the first failure came (load-free)
        self._last: tuple[Pair, int] | None = None
        self._failure: tuple[str, bool] | None = None
        self._batch_seed = seed
        self._last_report = 0.0
        self.spent = False  # check_budget raised BudgetSpent (whatever Hypothesis raised in its place)
        self._tests: dict[int, Any] = {}  # schedules per batch -> the Hypothesis test of such a batch

    def out_of_time(self) -> bool:
        return self.deadline is not None and self.clock() >= self.deadline

    def check_budget(self) -> None:
        """Called before every schedule and every step.

        Raises:
            BudgetSpent: the time budget is spent.
        """
        if self.out_of_time():
            self.spent = True
            raise BudgetSpent

    def run(self) -> Finding | None:
        """Run batches until the budget is spent or a schedule fails; the finding (shrunk) or None.

        What is alive when it starts (sglang, torch and Hypothesis: some 700k objects) is frozen out of the
        garbage collector's full collections while it runs (``gc.freeze``, undone at the end; unless something
        froze objects before): each would walk them all again, for no garbage (some 2 % of a run's time).
        """
        freeze = gc.get_freeze_count() == 0
        if freeze:
            gc.freeze()
        try:
            return self._run()
        finally:
            if freeze:
                gc.unfreeze()

    def _run(self) -> Finding | None:
        batch = 0
        while self.finding is None:
            if self.examples is not None and self.progress.schedules >= self.examples:
                self.stopped = "examples"
                break
            if self.out_of_time():
                self.stopped = "time"
                break
            n = BATCH if self.examples is None else max(1, min(BATCH, self.examples - self.progress.schedules))
            self._batch_seed = self.seed + batch
            batch += 1
            before = (self.progress.schedules, self.progress.steps)
            outcome = "clean"
            try:
                self._run_batch(n)
            except BudgetSpent:
                outcome = self._stopped_mid_batch()
            except Flaky as e:
                if self.spent:  # the budget's stop, raised by Hypothesis's tree in its place (see BudgetSpent)
                    outcome = self._stopped_mid_batch()
                elif self.best is None:  # no schedule failed: the machine's draws, not sglang, were inconsistent
                    outcome = "abandoned: Hypothesis replayed a schedule that drew differently (nothing failed)"
                    self.report(f"explore: batch {self._batch_seed} {outcome}")
                else:
                    self._found(e)
                    self.stopped = outcome = "failure"
            except Exception as e:  # noqa: BLE001 - any failure of a schedule is what exploration looks for
                self._found(e)
                self.stopped = outcome = "failure"
            done = (self.progress.schedules - before[0], self.progress.steps - before[1])
            self.batches.append(Batch(self._batch_seed, *done, outcome))
            if outcome.startswith("time"):
                break
        self.report(self.progress.line() + f"; stopped: {self.stopped}")
        return self.finding

    def _stopped_mid_batch(self) -> str:
        """The budget ran out inside a batch: the shortest failing schedule seen (if any) is the finding,
        shrunk further by replay when it is long. That pass is bounded (one replay per step, milliseconds
        each) and runs past the budget: a budget spent in Hypothesis's shrinking left schedules of 13 steps
        whose probes and repeated waits a replay drops (prealloc-no-swa-evict, seed 1, 1 and 3 minutes)."""
        self.stopped = "time, mid-batch"
        if self.best is not None:
            self.finding = replace(self.best, shrunk=False)
            if len(self.finding.steps) > SHORT:
                self.finding = shrink_by_replay(self.finding, self.run_dir)
        return self.stopped

    def _run_batch(self, n: int) -> None:
        """One Hypothesis run of ``n`` schedules with this batch's seed. The test is built once per batch size
        and run again with each batch's seed (building one digests the machine's source: a parse of this module)."""
        test = self._tests.get(n)
        if test is None:
            from hypothesis.stateful import get_state_machine_test

            machine = type("ExploreMachine", (PairMachine,), {"session": self})
            options = settings(
                max_examples=n,
                stateful_step_count=MAX_STEPS,
                deadline=None,
                database=None,
                derandomize=False,
                report_multiple_bugs=False,
                print_blob=False,
                suppress_health_check=list(HealthCheck),
                phases=[Phase.generate, Phase.shrink],
            )
            test = self._tests[n] = get_state_machine_test(machine, settings=options)
        hypothesis_seed(self._batch_seed)(test)
        test()

    def _found(self, error: BaseException) -> None:
        if self._last is None:
            raise error
        if isinstance(error, Flaky) and self.best is not None:
            # Hypothesis's shrinker lost its way (its replay of a choice sequence drew differently); the
            # shortest failing schedule seen is real (it ran): shrink it further by replaying without steps.
            self.finding = shrink_by_replay(self.best, self.run_dir)
            return
        pair, batch_seed = self._last
        message, at_end = self._failure or (_describe(error), False)
        self.finding = Finding(
            seed=batch_seed,
            config=pair.config,
            steps=list(pair.steps),
            failure=message,
            at_end=at_end,
            log=list(pair.log),
            faults=self.faults,
        )
        if len(self.finding.steps) > SHORT:  # Hypothesis stops at a local minimum; a replay pass goes on
            self.finding = shrink_by_replay(self.finding, self.run_dir)

    # -- called by the machine ---------------------------------------------------------------

    def start(self, pair: Pair) -> None:
        self._last = (pair, self._batch_seed)
        self._failure = None

    def ended(self, pair: Pair) -> None:
        """A schedule ended (its pair closed): keep it as :attr:`best` if it failed and is the shortest."""
        if self._failure is None or (self.best is not None and len(self.best.steps) <= len(pair.steps)):
            return
        message, at_end = self._failure
        self.best = Finding(
            self._batch_seed, pair.config, list(pair.steps), message, at_end, list(pair.log), self.faults
        )

    def failed(self, message: str, at_end: bool) -> None:
        self._failure = (message, at_end)
        if self.first_failure_s is None:
            self.first_failure_s = time.perf_counter() - self.progress.started
            self.first_failure_at = (self.progress.schedules, self.progress.steps)

    def timed(self, name: str, seconds: float) -> None:
        p = self.progress
        p.rule_seconds[name] += seconds
        p.rule_calls[name] += 1
        p.steps += 1
        now = time.perf_counter()
        if now - self._last_report >= 5.0:
            self._last_report = now
            self.report(p.line())


def failure_kind(failure: str) -> str:
    """What a failure is, without where: its error's name and its first ``[rule]`` tag, if any
    (``step 4 (commit): Broken: ledger: [page-leak] …`` -> ``Broken [page-leak]``)."""
    name = re.search(r"(\w+): ", failure.split("): ", 1)[-1] if "): " in failure else failure.split(": ", 1)[-1])
    tag = re.search(r"\[[\w-]+\]", failure)
    return " ".join(m.group(1) if m.lastindex else m.group(0) for m in (name, tag) if m)


def shrink_by_replay(finding: Finding, run_dir: Path) -> Finding:
    """Drop steps one at a time, last first, while a replay without the step still fails the same way
    (:func:`failure_kind`); a step whose request ids the later steps name is kept by that test itself."""
    kind = failure_kind(finding.failure)
    steps = [(s.op, dict(s.args)) for s in finding.steps]
    best = replay(finding.config, steps, run_dir)
    if best.failure is None or failure_kind(best.failure) != kind:
        return finding
    for i in reversed(range(len(steps))):
        if i >= len(steps):
            continue
        candidate = _without_request(steps, i) if steps[i][0] in ("submit", "probe") else steps[:i] + steps[i + 1 :]
        done = replay(finding.config, candidate, run_dir)
        if done.failure is not None and failure_kind(done.failure) == kind:
            steps, best = candidate, done
    assert best.failure is not None
    return replace(finding, steps=best.steps, failure=best.failure, at_end=best.at_end, log=best.log)


def _without_request(steps: list[tuple[str, dict[str, Any]]], i: int) -> list[tuple[str, dict[str, Any]]]:
    """``steps`` without the request step ``i`` submits (or probes): the steps naming it go too, and the
    requests submitted after it are renamed one down, as a pair numbers them (``r5`` becomes ``r4``)."""
    k = sum(op in ("submit", "probe") for op, _ in steps[:i])
    out = []
    for j, (op, args) in enumerate(steps):
        rid = args.get("rid")
        if j == i or rid == f"r{k}":
            continue
        if isinstance(rid, str) and rid[1:].isdigit() and int(rid[1:]) > k:
            args = {**args, "rid": f"r{int(rid[1:]) - 1}"}
        out.append((op, args))
    return out


def _describe(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:400]


@functools.lru_cache(maxsize=None)
def _prompt_lens(P: int) -> st.SearchStrategy[int]:
    """A prompt length near a page boundary (``k * P - 1 .. k * P + 1``) or anywhere up to five pages: one
    strategy per page size (built once: a strategy validates itself at its first draw)."""
    near_page = st.builds(lambda k, d: max(1, k * P + d), st.integers(1, 5), st.integers(-1, 1))
    return st.one_of(near_page, st.integers(1, 5 * P))


#: Decode tokens of a submitted request: a few, or :data:`LONG_STEPS`.
_DECODE_STEPS = st.one_of(st.integers(1, 6), st.just(LONG_STEPS))


def _can(op: str) -> Callable[[Any], bool]:
    """A precondition: ``op`` has a request to act on."""
    return lambda self: self.pair is not None and bool(self.pair.candidates(op))


class PairMachine(RuleBasedStateMachine):
    """Rules over one :class:`Pair`: every operation of the PD lifecycle, each picking the request it acts on
    by an index into the requests it may act on (so shrinking moves to the first one)."""

    session: Session

    def __init__(self) -> None:
        super().__init__()
        self.pair: Pair | None = None

    @initialize(data=st.data())
    def build(self, data: st.DataObject) -> None:
        self.session.check_budget()
        hisparse = data.draw(st.integers(0, 3), label="hisparse") == 3
        P = HISPARSE_PAGE if hisparse else data.draw(st.sampled_from(PAGE_SIZES), label="page_size")
        config = PairConfig(
            page_size=P,
            window=data.draw(st.integers(max(2, P // 2), 4 * P), label="window"),
            full_pages=data.draw(st.integers(12, 64), label="full_pages"),
            # DeepSeek-V4's SWA pool holds a 128-token window per request: a few pages, far fewer than full.
            # Half the schedules get a tight SWA pool: only there does a request's tail outgrow the free SWA
            # pages while the decode radix cache holds evictable ones (sglang#40309's reclaim).
            swa_pages=data.draw(
                st.integers(2, 6) if hisparse else st.one_of(st.integers(2, 5), st.integers(2, 48)), label="swa_pages"
            ),
            req_slots=data.draw(st.integers(2, 6), label="req_slots"),
            radix_cache=not hisparse and data.draw(st.booleans(), label="radix_cache"),  # as in sglang
            eviction_interval=data.draw(st.sampled_from((1, 2, 16)), label="eviction_interval"),
            chunk_pages=data.draw(st.integers(1, 4), label="chunk_pages"),
            hisparse=hisparse,
        )
        self.session.progress.schedules += 1
        inject.rearm()
        self.pair = Pair(config, self.session.run_dir)
        self.session.start(self.pair)

    def _do(self, op: str, **args: Any) -> None:
        assert self.pair is not None
        self.session.check_budget()
        t0 = time.perf_counter()
        index = len(self.pair.steps) + 1
        try:
            self.pair.apply(op, **args)
        except Exception as e:
            self.session.failed(f"step {index} ({op}): {_describe(e)}", False)
            raise
        finally:
            self.session.timed(op, time.perf_counter() - t0)

    def _pick(self, op: str, pick: int) -> str:
        assert self.pair is not None
        rids = self.pair.candidates(op)
        return rids[pick % len(rids)]

    @precondition(lambda self: self.pair is not None and len(self.pair.reqs) < 2 * self.pair.config.req_slots)
    @rule(data=st.data(), group=st.integers(0, 2))
    def submit(self, data: st.DataObject, group: int) -> None:
        """A request: its prompt near a page boundary or anywhere, and a few decode tokens or many (a window
        slides past a page only in a long one)."""
        assert self.pair is not None
        length = data.draw(_prompt_lens(self.pair.config.page_size), label="prompt_len")
        steps = data.draw(_DECODE_STEPS, label="steps")
        self._do("submit", prompt_len=length, group=group, steps=steps)

    @precondition(lambda self: self.pair is not None and bool(self.pair.candidates("advance")))
    @rule(pick=st.integers(0, 7), n=st.integers(1, 8))
    def advance(self, pick: int, n: int) -> None:
        """Up to ``n`` of a request's next operations on the way to decoding (prealloc, prefill, a chunk,
        commit), each its own step: the rules are drawn alike, so without this one a request rarely gets
        through its phases before an abort."""
        assert self.pair is not None
        rid = self._pick("advance", pick)
        for _ in range(n):
            if rid not in self.pair.candidates("advance"):
                break
            before = len(self.pair.steps)
            self._do(self.pair.next_op(rid), rid=rid)
            if "waits" in self.pair.steps[before].outcome:
                break

    @precondition(_can("prealloc"))
    @rule(pick=st.integers(0, 7))
    def prealloc(self, pick: int) -> None:
        self._do("prealloc", rid=self._pick("prealloc", pick))

    @precondition(_can("prefill"))
    @rule(pick=st.integers(0, 7))
    def prefill(self, pick: int) -> None:
        self._do("prefill", rid=self._pick("prefill", pick))

    @precondition(_can("transfer"))
    @rule(pick=st.integers(0, 7))
    def transfer(self, pick: int) -> None:
        self._do("transfer", rid=self._pick("transfer", pick))

    @precondition(_can("commit"))
    @rule(pick=st.integers(0, 7))
    def commit(self, pick: int) -> None:
        self._do("commit", rid=self._pick("commit", pick))

    @precondition(lambda self: self.pair is not None and bool(self.pair.running()))
    @rule(n=st.integers(1, 4), past_window=st.integers(0, 5))
    def decode(self, n: int, past_window: int) -> None:
        """``n`` decode steps, or (one draw in six) as many as slide the window a page and the eviction
        interval past where it started, when that is at most :data:`LONG_STEPS`."""
        assert self.pair is not None
        c = self.pair.config
        slide = c.window + 2 * c.page_size + c.eviction_interval
        self._do("decode", n=slide if past_window == 5 and slide <= LONG_STEPS else n)

    @precondition(lambda self: self.pair is not None and self.pair.probes() < 2)
    @rule()
    def probe(self) -> None:
        """A health probe (sglang's ``/health_generate``: a one-token request named ``HEALTH_CHECK_…``); two
        a schedule at most (a rule without arguments is otherwise drawn in every other step)."""
        self._do("probe")

    @precondition(_can("abort"))
    @rule(pick=st.integers(0, 7), fail=st.booleans())
    def abort(self, pick: int, fail: bool) -> None:
        """Abort a request at any phase, or (one still in transfer) fail its transfer: one rule, so giving
        requests up is drawn no more often than any other operation."""
        assert self.pair is not None
        rid = self._pick("abort", pick)
        self._do("fail" if fail and rid in self.pair.candidates("fail") else "abort", rid=rid)

    @precondition(_can("retract"))
    @rule(pick=st.integers(0, 7))
    def retract(self, pick: int) -> None:
        self._do("retract", rid=self._pick("retract", pick))

    @precondition(lambda self: self.pair is not None and bool(self.pair.retracted()))
    @rule()
    def resume(self) -> None:
        self._do("resume")

    @precondition(lambda self: self.pair is not None and self.pair.cached())
    @rule()
    def flush(self) -> None:
        self._do("flush")

    @invariant()
    def holds(self) -> None:
        if self.pair is None:
            return
        try:
            self.pair.check()
        except Exception as e:
            self.session.failed(f"after step {len(self.pair.steps)}: {_describe(e)}", False)
            raise

    def teardown(self) -> None:
        if self.pair is None:
            return
        try:
            self.pair.close()
        except Exception as e:
            if self.session._failure is None:
                self.session.failed(f"at the end: {_describe(e)}", True)
                raise
        finally:
            self.session.ended(self.pair)


def write_repro(finding: Finding, path: Path) -> Path:
    """Write ``finding`` as a repro file (JSON: seed, pools, faults, steps, failure)."""
    data = {
        "version": REPRO_VERSION,
        "kind": REPRO_KIND,
        "seed": finding.seed,
        "config": asdict(finding.config),
        "faults": finding.faults,
        "steps": [s.to_dict() for s in finding.steps],
        "failure": finding.failure,
        "at_end": finding.at_end,
        "shrunk": finding.shrunk,
        "events": len(finding.log),
        "events_sha256": events_digest(finding.log),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    return path


def events_bytes(log: list[str]) -> bytes:
    """The ledger events of a schedule as the bytes a replay must reproduce: one JSON line each, in the order
    written, without their wall-clock time."""
    return "".join(line + "\n" for line in log).encode()


def events_digest(log: list[str]) -> str:
    return hashlib.sha256(events_bytes(log)).hexdigest()


def is_repro(path: Path) -> bool:
    """Whether ``path`` holds an explore repro (by its kind; one written before kinds, by its fields)."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and (data.get("kind") == REPRO_KIND or {"steps", "config", "seed"} <= data.keys())


def read_repro(path: Path) -> dict[str, Any]:
    """Read a repro file.

    Raises:
        ValueError: it is not one (unreadable, another version, or fields missing).
    """
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if data.get("kind", REPRO_KIND) != REPRO_KIND:
            raise ValueError(f"kind {data.get('kind')!r}, not {REPRO_KIND!r}")
        if data.get("version") != REPRO_VERSION:
            raise ValueError(f"version {data.get('version')!r}, this harness reads {REPRO_VERSION}")
        data["config"] = PairConfig(**data["config"])
        data["steps"] = [(s["op"], dict(s["args"])) for s in data["steps"]]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{path}: not an explore repro file ({e})") from None
    return data


@dataclass
class Replayed:
    """What a replay did: its steps, the failure (None: none), and the ledger events as JSON lines."""

    steps: list[Step]
    failure: str | None
    at_end: bool
    log: list[str]

    def log_bytes(self) -> bytes:
        return events_bytes(self.log)


def replay(config: PairConfig, steps: list[tuple[str, dict[str, Any]]], run_dir: Path) -> Replayed:
    """Run ``steps`` on a fresh pair of ``config``, checking the invariants after each, then the end checks.

    Args:
        config: the pools.
        steps: ``(operation, arguments)`` in order.
        run_dir: where the ranks write their ledgers.

    Returns:
        The :class:`Replayed`; the first failure stops the steps (the end checks still run, unjudged).
    """
    inject.rearm()
    pair = Pair(config, run_dir)
    failure: str | None = None
    at_end = False
    try:
        for i, (op, args) in enumerate(steps, 1):
            try:
                pair.apply(op, **args)
            except Exception as e:  # noqa: BLE001 - the failure is the replay's result
                failure = f"step {i} ({op}): {_describe(e)}"
                break
            try:
                pair.check()
            except Exception as e:  # noqa: BLE001
                failure = f"after step {i}: {_describe(e)}"
                break
    finally:
        try:
            pair.close()
        except Exception as e:  # noqa: BLE001
            if failure is None:
                failure, at_end = f"at the end: {_describe(e)}", True
    return Replayed(steps=list(pair.steps), failure=failure, at_end=at_end, log=list(pair.log))
