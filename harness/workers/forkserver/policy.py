"""Whether a process the harness starts runs as a fork of a preloaded fork server: one rule for every
kind of process, and one switch.

A process (kind ``rank``, ``server`` or ``python``) is forked only when it drives no real GPU and the fork
server can run beside it, unless ``HARNESS_FORK_START=0`` (:data:`OFF_ENV`). The kinds and the old
per-kind switches: docs/modules.md.
"""

from __future__ import annotations

import logging
import os
from typing import Literal, Mapping

log = logging.getLogger(__name__)

Kind = Literal["rank", "server", "python"]

#: ``0``: no process the harness starts is a fork of a fork server.
OFF_ENV = "HARNESS_FORK_START"
#: Each kind's switch from before :data:`OFF_ENV`; still honoured (``0`` turns that kind off), with a warning.
OLD_ENV: dict[str, str] = {
    "rank": "HARNESS_RANK_FORKSERVER",
    "server": "HARNESS_SERVER_FORKSERVER",
    "python": "HARNESS_FORK_PYTHON",
}
_WARNED: set[str] = set()


def forks(kind: Kind, *, real_devices: bool = False, local: bool = True, env: Mapping[str, str] | None = None) -> bool:
    """Whether a process of ``kind`` starts as a fork of a preloaded fork server (see the module docstring).

    Args:
        kind: ``rank``, ``server`` or ``python``.
        real_devices: the process drives a real GPU (never forked).
        local: the fork server can run beside the process (a cluster this machine started).
        env: the environment that decides (default ``os.environ``; a Python subprocess's own
            environment, which may carry the switch).

    Returns:
        True when the process is started from a fork server.

    Raises:
        ValueError: ``kind`` is none of the three.

    >>> forks("rank", env={})
    True
    >>> forks("rank", real_devices=True, env={}), forks("server", local=False, env={})
    (False, False)
    >>> forks("python", env={"HARNESS_FORK_START": "0"})
    False
    """
    if kind not in OLD_ENV:
        raise ValueError(f"no such kind of process: {kind!r}; one of {', '.join(OLD_ENV)}")
    if real_devices or not local:
        return False
    env = os.environ if env is None else env
    if env.get(OFF_ENV, "1") == "0":
        return False
    old = OLD_ENV[kind]
    if env.get(old, "1") == "0":
        if old not in _WARNED:
            _WARNED.add(old)
            log.warning("%s=0 is deprecated: set %s=0 (it turns off every kind of fork start)", old, OFF_ENV)
        return False
    return True
