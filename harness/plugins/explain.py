"""pytest plugin concern: every failing test's first line says what broke, from the evidence.

For a failing test the plugin builds one headline (the *evidence class*, what the evidence names, where to
look in sglang) and makes it the failure's message, which pytest's summary line, the JUnit message, the
run page and the ``/rerun-test`` comment all start with; the traceback stays unchanged. The evidence
classes in the order :func:`headline` tries them: docs/modules.md.
"""

from __future__ import annotations

import logging
import re
import time
import traceback
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import pytest

from harness import ledger

log = logging.getLogger(__name__)

#: The longest headline; what is longer is cut at its end (the cause always comes first).
MAX_CHARS = 400
#: The classes, in the order :func:`headline` tries them.
CLASSES = (
    "ledger",
    "stall",
    "kv",
    "sglang-check",
    "worker-death",
    "timeout",
    "sglang-assert",
    "prealloc",
    "assertion",
    "error",
)
#: The ledger's components, as a stall headline names them (decode first: it holds the pages).
SIDES = ("decode", "prefill")

_ADAPTER = "/harness/targets/sglang/"
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_FRAME = re.compile(r'File "(?P<path>[^"]*?/sglang/[^"]+\.py)", line (?P<line>\d+), in (?P<func>[\w<>.]+)')
_TIMEOUT = re.compile(r"Timeout >|GetTimeoutError|TimeoutError|did not return within|timed out", re.I)


def clean(text: str) -> str:
    """``text`` on one line: ANSI colour codes stripped, white space folded.

    >>> clean("\\x1b[36mray::_WorkerActor.call()\\x1b[39m  done\\n  and more")
    'ray::_WorkerActor.call() done and more'
    """
    return " ".join(_ANSI.sub("", text).split())


def sglang_frames(text: str) -> list[str]:
    """Every traceback frame of ``text`` inside an ``sglang/`` package, as ``sglang/<path>:<line> in <func>``.

    >>> sglang_frames('  File "/venv/site-packages/sglang/srt/mem_cache/allocator/swa.py", line 210, in alloc')
    ['sglang/srt/mem_cache/allocator/swa.py:210 in alloc']
    """
    out = []
    for m in _FRAME.finditer(_ANSI.sub("", text)):
        path = m.group("path")
        if _ADAPTER in path:  # the harness's own adapter package, not sglang
            continue
        out.append(f"sglang/{path[path.rindex('/sglang/') + len('/sglang/') :]}:{m.group('line')} in {m.group('func')}")
    return out


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]


def _message(exc: BaseException) -> str:
    text = clean(str(exc))
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _check_hit(text: str) -> tuple[str, str]:
    """``("[<check>: <what it names>]", <the line of the hit>)`` for the first hit of one of sglang's
    own checks in ``text``, or ``("", "")``.

    >>> name, line = _check_hit("x\\nValueError: token_to_kv_pool_allocator memory leak detected! available_size=3\\ny")
    >>> name, line.removeprefix("ValueError: token_to_kv_pool_allocator ")
    ('[mem-check-idle: token_to_kv_pool_allocator]', 'memory leak detected! available_size=3')
    """
    from harness.targets.sglang.compat.checks import hit

    found = hit(text)
    if found is None:
        return "", ""
    check, what, line = found
    return f"[{check.name}: {what}]", clean(line)[:240]


def _assertion(exc: AssertionError) -> str:
    """An assertion's message without its class name, pytest's rewritten comparison after a bar.

    >>> _assertion(AssertionError("free pages 3 != 4 after release\\nassert 3 == 4"))
    'free pages 3 != 4 after release | assert 3 == 4'
    """
    if type(exc) is not AssertionError or not str(exc).strip():
        return _message(exc)
    said, _, compared = str(exc).strip().partition("\n")
    return clean(said) + (f" | {clean(compared)}" if compared.strip() else "")


def _suspect_text(key: str, root: Path | None) -> str:
    from harness.targets.sglang.compat.suspects import suspects

    found = suspects(key, root)
    if not found:
        return ""
    also = [s.qualname for s in found[1:3]]
    return f" | suspect: {found[0]}" + (f" (also {', '.join(also)})" if also else "")


def _first_cause(violations: Sequence[ledger.Violation]) -> tuple[ledger.Violation, str]:
    """The earliest root cause, and ``<its headline> (+N more: knock-ons and other roots)``."""
    causes = ledger.root_causes(violations)
    first = causes[0].root
    follow = [k.rule for c in causes for k in c.knock_ons] + [c.root.rule for c in causes[1:]]
    more = f" (+{len(follow)} more: {', '.join(dict.fromkeys(follow))})" if follow else ""
    return first, f"{first.headline()}{more}"


def _ledger_line(violations: Sequence[ledger.Violation], root: Path | None) -> str:
    """``ledger <the earliest root cause> (+N more: knock-ons and other roots) | suspect: ...``."""
    first, said = _first_cause(violations)
    return f"ledger {said}{_suspect_text(first.rule, root)}"


def _found_at_end(violations: Sequence[ledger.Violation]) -> bool:
    """Whether every violation was found by the end-of-run check (no event broke a rule on its own)."""
    return all(v.seq is None for v in violations)


def _then_found(violations: Sequence[ledger.Violation]) -> str:
    """``; the ledger then found <the earliest root cause> (+N more: ...)``: what followed a refused prealloc."""
    return f"; the ledger then found {_first_cause(violations)[1]}"


def _carrier(exc: BaseException) -> BaseException | None:
    """The first exception of the failure's chain that carries ledger ``violations``, if any."""
    return next((e for e in _chain(exc) if getattr(e, "violations", None)), None)


def _timed_out(exc: BaseException) -> bool:
    """Whether the failure's chain holds a timeout (a client's ``Read timed out``, a bounded wait's)."""
    return any(_TIMEOUT.search(_message(e)) or type(e).__name__ in ("Timeout", "ReadTimeout") for e in _chain(exc))


def _side(component: str, rid: str, events: Sequence[ledger.Event], start: float, failed_at: float) -> str:
    """Where one side was with ``rid`` when the test failed: its last phase (the kind of its last event
    before the failure) and how long after the test's start, or that it has none."""
    mine = [e for e in events if e.component == component and e.rid == rid and e.ts <= failed_at]
    if mine:
        last = max(mine, key=lambda e: (e.ts, e.seq))
        quiet = failed_at - last.ts
        return f"{component} {last.kind} at +{last.ts - start:.2f} s" + (
            f", nothing after it for {quiet:.0f} s" if quiet >= 1 else ""
        )
    if any(e.component == component and not e.rid.startswith("<") for e in events):
        return f"{component} never scheduled it"
    return f"{component} recorded nothing of it (no request's events in its ledger)"


def _trace(item: pytest.Item) -> list:
    """The phase trace of the session's servers (:mod:`harness.engines.phases`), empty without one."""
    from harness.engines import phases
    from harness.plugins.state import state_key

    st = item.config.stash.get(state_key, None)
    return phases.read_trace(Path(st.run_dir_path) / "ledger") if st is not None else []


def stall_line(
    flying: Sequence[ledger.Violation],
    events: Sequence[ledger.Event],
    *,
    start: float,
    failed_at: float,
    read_at: float,
    marks: Sequence = (),
) -> str:
    """The first line of a test that failed while requests were in flight (on a timeout: it stalled).

    ``stall: request R: decode <last phase> at +T s[, nothing after it for N s]; prefill <last phase,
    'never scheduled it', or that its ledger holds no request's events>``, then what came after the
    failure (the release the client's abort set off, or that it is still in flight), for the request
    that stalled longest; ``(+N more in flight)`` counts the others. ``+T`` counts from the test's start.

    Args:
        flying: the :data:`harness.ledger.IN_FLIGHT` findings at the failure.
        events: every event of the ledgers the test's workers wrote, as read last (after the failure).
        start: when the test started (epoch seconds, as the events' ``ts``).
        failed_at: when it failed.
        read_at: when ``events`` were read.
        marks: the servers' phase trace; where it holds the request, it says where each side was
            (:func:`harness.engines.phases.stall_story`) instead of the ledger's last kinds.
    """

    def stalled_since(v: ledger.Violation) -> float:
        return max((e.ts for e in events if e.rid == v.rid and e.ts <= failed_at), default=failed_at)

    rids = list(dict.fromkeys(v.rid for v in sorted(flying, key=stalled_since)))
    rid = rids[0]
    from harness.engines import phases

    story = phases.stall_story([m for m in marks if m.t <= failed_at], rid, start)
    sides = story or "; ".join(_side(c, rid, events, start, failed_at) for c in SIDES)
    release = next(
        (e for e in sorted(events, key=lambda e: e.ts) if e.rid == rid and e.kind == "release" and e.ts > failed_at),
        None,
    )
    if release is not None:
        why = f" ({release.note})" if release.note else ""
        after = f" | {release.component} released it {release.ts - failed_at:.1f} s after the failure{why}"
    else:
        after = f" | still in flight {read_at - failed_at:.0f} s after the failure"
    more = f" (+{len(rids) - 1} more in flight)" if len(rids) > 1 else ""
    return f"stall: request {rid}: {sides}{after}{more}"


def _flying_brief(flying: Sequence[ledger.Violation]) -> str:
    """``request R (decode-0, last phase prealloc)``, and how many more, for a line that leads with something else."""
    v = flying[0]
    more = f" (+{len(flying) - 1} more)" if len(flying) > 1 else ""
    return f"request {v.rid} ({v.worker}, last phase {v.kind}){more}"


def _where(frames: Sequence[str]) -> str:
    return f" | last sglang frame: {frames[-1]}" if frames else ""


def _traceback_text(exc: BaseException) -> str:
    parts = ["".join(traceback.format_tb(exc.__traceback__))]
    parts += list(getattr(exc, "__notes__", ()) or ())
    return "\n".join(parts)


def headline(exc: BaseException, *, logs: Iterable[str] = (), root: Path | None = None) -> tuple[str, str]:
    """The evidence class of a failure and its one-line headline.

    Args:
        exc: what the test raised.
        logs: the log tails of the workers the test owned (read for sglang frames).
        root: the directory holding the target's ``sglang/`` (suspects are named in it; None: as
            mapped, without checking the release has them).

    Returns:
        ``(class, headline)``; the class is one of :data:`CLASSES`.
    """
    chain = list(_chain(exc))
    logs = list(logs)
    died = next((e for e in chain if _is(e, "WorkerDied")), None)
    evidence = "\n".join(
        [
            *(f"{type(e).__name__}: {e}\n{_traceback_text(e)}" for e in chain),
            *([died.tail] if died is not None else []),
            *logs,
        ]
    )
    label, hit_line = _check_hit(evidence)
    carrier = _carrier(exc)
    # A request still in flight breaks no rule: a carrier of nothing else is no ledger failure.
    violations, flying = ledger.split_in_flight(getattr(carrier, "violations", None) or ())
    broken = carrier if violations else None
    pre = next((e for e in chain if _is(e, "PreallocError")), None)
    if broken is not None and pre is not None and _found_at_end(violations):
        # sglang refused a prealloc mid-run, keeping the pages it had taken; every rule the ledger
        # found broken it found at the end (the leaks those pages are): the refusal came first.
        return "prealloc", _fit(
            f"prealloc {_message(pre)}{_suspect_text('PreallocError', root)}" + _then_found(violations)
        )
    if broken is not None:
        said = _message(broken)
        if label:  # sglang's own check saw it too (and, when the hit is what stopped the run, stopped it)
            stopped = f"; sglang's check agreed: {label} " + (said if hit_line in said else hit_line)
        elif isinstance(broken, ledger.LedgerBroken) or type(broken).__name__ == "PDError":
            stopped = ""
        else:
            stopped = f"; it stopped the run as {said}"
        return "ledger", _fit(_ledger_line(violations, root) + stopped)
    if (
        flying
        and pre is None
        and (_timed_out(exc) or isinstance(carrier, ledger.LedgerBroken) or type(carrier).__name__ == "PDError")
    ):
        # the ledger check (or a timeout) found only requests still in flight: the test stalled on them
        return "stall", _fit(f"stall: {_flying_brief(flying)} still in flight; the test saw: {_message(exc)}")
    kv = next((e for e in chain if _is(e, "KVCorruption", "WindowLost")), None)
    if kv is not None:
        return "kv", _fit(f"kv {_message(kv)}{_suspect_text(type(kv).__name__, root)}")
    if label:
        return "sglang-check", _fit(f"sglang-check {label} {hit_line}{_where(sglang_frames(evidence))}")
    if died is not None:
        frames = sglang_frames(died.tail)
        return "worker-death", _fit(f"worker-death {died.name}: {clean(died.cause)}{_where(frames)}")
    text = "\n".join(_traceback_text(e) for e in chain)
    frames = sglang_frames(text)
    if any(_TIMEOUT.search(_message(e)) for e in chain[:1]) or type(exc).__name__ == "Timeout":
        log_frames = [f for log in logs for f in sglang_frames(log)]
        return "timeout", _fit(f"timeout {_message(exc)}{_where(log_frames or frames)}")
    innermost = frames[-1] if frames else ""
    if innermost and _last_frame_is_sglang(exc):
        return "sglang-assert", _fit(f"sglang-assert {_message(exc)} | at {innermost}")
    if pre is not None:
        return "prealloc", _fit(f"prealloc {_message(pre)}{_suspect_text('PreallocError', root)}")
    if isinstance(exc, AssertionError):
        return "assertion", _fit(f"assertion {_assertion(exc)}")
    return "error", _fit(f"error {_message(exc)}{_where(frames)}")


def _is(exc: BaseException, *names: str) -> bool:
    """Whether ``exc`` is one of the harness's error classes ``names`` (by class name along its MRO:
    the headline must not import the PD engine, numpy or Ray to classify a failure, and a rebuilt
    remote exception is a subclass of its cause's class)."""
    return any(cls.__name__ in names and cls.__module__.startswith("harness.") for cls in type(exc).__mro__)


def _last_frame_is_sglang(exc: BaseException) -> bool:
    """Whether the exception was raised inside sglang: its innermost local frame, or the innermost
    frame of the remote traceback a worker attached."""
    notes = [n for n in getattr(exc, "__notes__", None) or () if "remote traceback" in n]
    if notes:  # raised in a worker: its own traceback says where
        files = re.findall(r'File "([^"]+)", line \d+', notes[-1])
        return bool(files) and "/sglang/" in files[-1]
    tb = traceback.extract_tb(exc.__traceback__)
    return bool(tb) and "/sglang/" in tb[-1].filename


def _fit(text: str) -> str:
    line = clean(text)
    return line if len(line) <= MAX_CHARS else line[: MAX_CHARS - 1] + "…"


def _target_root() -> Path | None:
    """The directory holding the session's target ``sglang/`` (resolved, not activated: explaining a
    failure changes nothing of the process)."""
    import os

    from harness.targets.sglang import selection

    try:
        return Path(selection.resolve(os.environ.get(selection.ENV_VAR) or selection.INSTALLED).root)
    except selection.TargetError:
        return None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[pytest.TestReport]:
    report = yield
    crash = getattr(report.longrepr, "reprcrash", None)
    if not report.failed or call.excinfo is None or crash is None:
        return report
    try:
        kind, line = _explain(item, call, report)
    except Exception as e:  # noqa: BLE001 - explaining a failure must never turn it into another one
        log.warning("no failure headline for %s: %r", item.nodeid, e)
        return report
    from harness.plugins.stackwatch import stalls

    aborted = stalls(item)
    if aborted and kind != "ledger" and report.when == "call":
        # The watcher aborted a request that made no progress (its bound before the client's): where each
        # side was leads; what the test then saw follows from the abort.
        kind, line = "stall", _fit(f"{aborted[0].line()}; the test saw: {line}")
    crash.message = line
    report.user_properties.append(("evidence", kind))
    known = known_race(kind, line)
    lost = [m for m in _trace(item) if m.phase == "transfer.lost-update" and m.t >= call.start]
    if known is None and lost and report.when == "call":
        # The probe proved sglang's lost update during the test and the harness aborted that request at
        # once (plugins/servers.py): what the test then saw follows from the race.
        known = KNOWN_RACES["a lost status update"]
        line = _fit(f"stall: room {lost[0].room} lost its status update (the harness aborted it); the test saw: {line}")
        crash.message = line
    if known is not None and report.when == "call":
        # A known upstream race, proven on this run's trace, hit by chance: the test is reported xfailed
        # with the evidence (as pytest's own xfail does), not failed, and not hidden.
        report.outcome = "skipped"
        report.wasxfail = f"{known}: {line}"
        report.user_properties.append(("known_race", known))
        item.stash[known_race_key] = known
    return report


#: On a test reported xfailed for a known race: the race (its servers' reset then judges its aftermath).
known_race_key = pytest.StashKey[str]()

#: Upstream races a stall headline can prove from the phase trace (the words it then holds), each with
#: the strict xfail that forces it on purpose. A test that stalls on one by chance is reported xfailed.
KNOWN_RACES = {
    "a lost status update": (
        "sglang's CommonKVManager.update_status loses decode's WaitingForInput under prefill's Bootstrapping "
        "(forced in test_disaggregation_inflight_server.py::test_a_status_write_racing_decodes_metadata_is_not_lost)"
    ),
    # A reset finding, not a stall: the probe marks it (transfer.resurrected) and the reset counts the rooms
    # apart; a test that hits it by chance passes with a KnownRaceWarning (plugins/servers.py).
    "a resurrected room": (
        "sglang's CommonKVManager.update_status leaves rooms no sender holds in prefill's KV manager (decode's "
        "late WaitingForInput after an abort or a refusal, or a transfer worker's Failed read before the clear), "
        "kept for good (forced in "
        "test_disaggregation_inflight_server.py::test_a_page_list_after_prefills_abort_leaves_no_room)"
    ),
}


class KnownRaceWarning(UserWarning):
    """A known upstream race hit by chance, proved on the run's trace (:data:`KNOWN_RACES`)."""


def known_race(kind: str, line: str) -> str | None:
    """The :data:`KNOWN_RACES` entry a failure's headline proves (None: none)."""
    return next((why for what, why in KNOWN_RACES.items() if kind == "stall" and what in line), None)


def _explain(item: pytest.Item, call: pytest.CallInfo, report: pytest.TestReport) -> tuple[str, str]:
    assert call.excinfo is not None
    logs = [text for name, text in report.sections if name.startswith("worker ")]
    root = _target_root()
    kind, line = headline(call.excinfo.value, logs=logs, root=root)
    if kind != "ledger" and report.when == "call":
        # What the test saw may follow from a rule its workers broke first (a real server's ledger
        # probe): then that rule is the root cause and leads; what the test saw comes after it. When
        # the test gave up on a request still in flight (a client's timeout, a bounded wait), its
        # servers first get a bounded chance to write what that set off (an abort's release).
        from harness.plugins.record import read_ledger, settle

        at_failure = read_ledger(item)
        stalled = kind == "stall" or _timed_out(call.excinfo.value)
        now = settle(lambda: read_ledger(item)) if at_failure.in_flight and stalled else at_failure
        found, still = ledger.split_in_flight(now.violations)
        if found and kind == "prealloc" and _found_at_end(found):
            if _carrier(call.excinfo.value) is None:  # else headline() said what the refusal carried
                line = _fit(line + _then_found(found))  # a refused prealloc's kept pages: the refusal leads
        elif found:
            kind, line = "ledger", _fit(f"{_ledger_line(found, root)}; the test saw: {line}")
        elif at_failure.in_flight and stalled:
            said = _message(call.excinfo.value) if kind == "stall" else line
            stall = stall_line(
                at_failure.in_flight,
                now.events,
                start=call.start,
                failed_at=call.stop,
                read_at=time.time(),
                marks=_trace(item),
            )
            kind, line = "stall", _fit(f"{stall}; the test saw: {said}")
        elif still:
            line = _fit(f"{line}; still in flight: {_flying_brief(still)}")
    return kind, line
