"""The coverage.py plugin each measured process loads (``[run] plugins``): it writes
``<dir>/<pid>.json`` (pid, parent pid, command line) once the process has imported sglang, forks included.

Why: a process killed by SIGKILL leaves no coverage data, which must read as "not measured", not "lines not
executed", and coverage.py keeps no list of its processes. Standard library only. When the record is
written: docs/modules.md.
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
