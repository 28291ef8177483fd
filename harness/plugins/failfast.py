"""pytest plugin concern: fail-fast — a worker's death fails the test that owns it, with log tails.

A watchdog polls every started worker; a death while a test body runs fails that test within about a
second with :class:`harness.workers.WorkerDied`, raised in its main thread through SIGUSR2, never
``os._exit``. Only owned workers count (:func:`own_workers`). How the death arrives inside ``ray.get``, and
ownership: docs/modules.md.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any, Callable, Iterator

import pytest

from harness.plugins.state import FAILFAST_SIGNAL, state_key

_workers_key = pytest.StashKey[list]()
_prev_handler_key = pytest.StashKey[Any]()

_RAY_DIR = f"{os.sep}ray{os.sep}"


def own_workers(item: pytest.Item, workers: list[Any]) -> None:
    """Make ``item`` (a test) own ``workers``: their deaths fail it, their log tails join its report.

    Args:
        item: the test (``request.node``).
        workers: the list of workers; kept by reference, so workers appended to it later (started
            on first use during the test) are owned too.
    """
    item.stash[_workers_key] = workers


def owned_workers(item: pytest.Item) -> list[Any]:
    """The workers ``item`` owns (empty when no fixture gave it any).

    Args:
        item: the test.

    Returns:
        The list passed to :func:`own_workers`, or an empty list.
    """
    return item.stash.get(_workers_key, [])


def pytest_configure(config: pytest.Config) -> None:
    if threading.current_thread() is threading.main_thread():
        config.stash[_prev_handler_key] = signal.signal(FAILFAST_SIGNAL, _failfast_handler(config))


def pytest_unconfigure(config: pytest.Config) -> None:
    prev = config.stash.get(_prev_handler_key, None)
    if prev is not None and threading.current_thread() is threading.main_thread():
        signal.signal(FAILFAST_SIGNAL, prev)


def _failfast_handler(config: pytest.Config) -> Callable[[int, Any], None]:
    def handler(signum: int, frame: Any) -> None:
        __tracebackhide__ = True
        state = config.stash.get(state_key, None)
        died = state.take_for_signal() if state is not None else None
        if died is None:
            return
        if _in_ray(frame):
            # Ray's blocking get only gives way to KeyboardInterrupt (any other exception stays
            # pending until the get returns); the call wrapper turns it back into the WorkerDied.
            state.ray_interrupt = died
            raise KeyboardInterrupt(f"harness: worker {died.name} died")
        raise died

    return handler


def _in_ray(frame: Any) -> bool:
    return frame is not None and _RAY_DIR in frame.f_code.co_filename


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    state = item.config.stash.get(state_key, None)
    if state is None or threading.current_thread() is not threading.main_thread():
        return (yield)
    state.ray_interrupt = None
    early = [d for d in state.arm() if _owns(item, d)]
    if early:
        state.disarm()
        raise early[0]
    __tracebackhide__ = True
    try:
        result = yield
    except KeyboardInterrupt as e:
        state.disarm()
        died, state.ray_interrupt = state.ray_interrupt, None
        if died is not None and _owns(item, died):
            raise died.with_traceback(e.__traceback__) from None  # points at the test's blocked line
        raise
    except SystemError as e:
        state.disarm()
        # The interrupt landed in C code that swallowed it until it returned, then wrapped it.
        inner = e.__cause__ or e.__context__
        if _is_worker_died(inner) and _owns(item, inner):
            raise inner.with_traceback(e.__traceback__) from None
        raise
    except BaseException:
        state.disarm()
        raise
    late = [d for d in state.disarm() if _owns(item, d)]
    if late:  # a worker died, yet the test passed: it swallowed the interrupt or ended just before it
        raise late[0]
    return result


def _is_worker_died(e: Any) -> bool:
    from harness.workers import WorkerDied

    return isinstance(e, WorkerDied)


def _owns(item: pytest.Item, died: Any) -> bool:
    return any(w.name == died.name for w in owned_workers(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[pytest.TestReport]:
    report = yield
    if report.failed:
        from harness.workers import TAIL_LINES

        for w in owned_workers(item):
            tail = w.tail(TAIL_LINES)
            report.sections.append((f"worker {w.name} log (last {TAIL_LINES} lines, {w.log_path})", tail or "(empty)"))
    return report
