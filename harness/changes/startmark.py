"""The coverage.py plugin each measured process loads (``[run] plugins``): it writes
``<dir>/<pid>.json`` (pid, parent pid, command line) once the process has imported sglang, forks included.

Why a plugin: coverage.py writes a process's data only when the process ends through ``exit``,
SIGTERM (``sigterm = true``) or ``os._exit`` (``patch = _exit``); a process killed by SIGKILL leaves
nothing, which must read as "not measured", not as "lines not executed". coverage.py records no list
of the processes it started in; its plugin start-up hook runs in every one (after a fork too, where
``patch = fork`` restarts the measurement), so that is where the list is kept. It registers no file
tracer or reporter, and imports only the standard library (every measured process loads it).

The record is written by a daemon thread, at the first look after :data:`FIRST_LOOK_S` that finds
``sglang`` imported: a process that never imports the target (an idle Ray worker, Ray's own helpers)
is no process whose lines are unknown, and a fork that execs another program at once (``subprocess``
with a ``preexec_fn`` runs the fork hooks that restart coverage before the ``exec``) is gone before it.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import Any

#: Seconds before the first look (longer than a fork takes to exec), then between looks.
FIRST_LOOK_S, LOOK_EVERY_S = 0.5, 1.0


def _record(where: str) -> None:
    os.makedirs(where, exist_ok=True)
    record = {"pid": os.getpid(), "ppid": os.getppid(), "argv": list(sys.argv)[:12]}
    tmp = os.path.join(where, f".{os.getpid()}.json")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(record, f)
    os.replace(tmp, os.path.join(where, f"{os.getpid()}.json"))


def _watch(where: str, pid: int) -> None:
    time.sleep(FIRST_LOOK_S)
    while os.getpid() == pid:
        if "sglang" in sys.modules:
            _record(where)
            return
        time.sleep(LOOK_EVERY_S)


def coverage_init(reg: Any, options: dict[str, str]) -> None:  # noqa: ARG001 - coverage.py's plugin signature
    """coverage.py's plugin entry point: record this process under ``options["dir"]`` (see the module docstring)."""
    where = options.get("dir")
    if where:
        threading.Thread(target=_watch, args=(where, os.getpid()), name="harness-startmark", daemon=True).start()
