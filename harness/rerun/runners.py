"""Which runner a CI job may run on: the label comes from the default branch's allow-list, never from a PR.

A plan may run a pull request's code, so every label in it is the PR's choice. A trusted job passes the matrix
through :func:`pin`: each entry's ``runner`` becomes the label ``ci/runners.json`` of the default branch gives its
topologies; anything not in the allow-list is refused with one line, and ``cpu_only`` (a fork's pull request)
refuses every entry that would leave the CPU runner. Standard library only. Detail: docs/modules.md.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

#: The allow-list's key for the CPU runner (the label simulated groups run on).
CPU_TOPOLOGY = "cpu"
#: A group, label or artifact name the workflows may put into a job name, an artifact name or a path.
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")
#: Most entries one matrix may hold (GitHub's own cap is 256 jobs).
MAX_ENTRIES = 64


class RunnerError(ValueError):
    """The matrix cannot be placed on runners the allow-list permits. One line."""


def load_allow_list(path: Path) -> dict[str, str]:
    """``ci/runners.json``: topology name -> runner label (both plain names).

    Raises:
        RunnerError: not a JSON object of names, or no ``cpu`` entry.
    """
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise RunnerError(f"{path}: cannot read the runner allow-list ({e.__class__.__name__}: {e})") from None
    if not isinstance(data, dict) or not all(
        isinstance(k, str) and isinstance(v, str) and NAME_RE.fullmatch(v) for k, v in data.items()
    ):
        raise RunnerError(f"{path}: the runner allow-list must map topology names to runner labels")
    if CPU_TOPOLOGY not in data:
        raise RunnerError(f"{path}: the runner allow-list has no {CPU_TOPOLOGY!r} entry")
    return data


def _name(entry: dict, key: str, i: int) -> str:
    value = entry.get(key)
    if not isinstance(value, str) or not NAME_RE.fullmatch(value):
        raise RunnerError(
            f"matrix entry {i}: {key} {str(value)[:60]!r} is not a plain name ([A-Za-z0-9._-], at most 100 characters)"
        )
    return value


def pin(matrix: object, allow: dict[str, str], *, cpu_only: bool = False) -> dict:
    """The matrix with every entry's ``runner`` taken from ``allow``.

    Args:
        matrix: ``{"include": [entry, ...]}`` as a plan printed it (untrusted). An entry names its topology
            (``topology``, rerun-test) or topologies (``topologies``, a gate); its ``name`` (and ``artifact``,
            when present) must be plain names.
        allow: :func:`load_allow_list`'s mapping.
        cpu_only: every entry must run on the CPU runner (a fork's pull request).

    Returns:
        A new matrix: the same entries, ``runner`` replaced.

    Raises:
        RunnerError: an entry the allow-list does not place, or a bad matrix (one line).
    """
    include = matrix.get("include") if isinstance(matrix, dict) else None
    if not isinstance(include, list) or not all(isinstance(e, dict) for e in include):
        raise RunnerError('the plan\'s matrix is not {"include": [entries]}')
    if len(include) > MAX_ENTRIES:
        raise RunnerError(f"the plan has {len(include)} groups; at most {MAX_ENTRIES} run from one request")
    cpu = allow[CPU_TOPOLOGY]
    out, names = [], set()
    for i, entry in enumerate(include):
        name = _name(entry, "name", i)
        if name in names:
            raise RunnerError(f"matrix entry {i}: group {name!r} appears twice")
        names.add(name)
        if "artifact" in entry:
            _name(entry, "artifact", i)
        topologies = entry.get("topologies", [entry.get("topology")])
        if not isinstance(topologies, list) or not topologies or not all(isinstance(t, str) for t in topologies):
            raise RunnerError(f"group {name}: names no topology")
        unknown = [t for t in topologies if t not in allow]
        if unknown:
            raise RunnerError(
                f"group {name}: topology {unknown[0][:60]!r} is not in the default branch's "
                f"ci/runners.json; a new topology runs here once it is merged"
            )
        labels = {allow[t] for t in topologies}
        if entry.get("runner") == cpu:
            label = cpu  # the CPU runner (a simulated GPU group, or a CPU topology): always allowed
        elif len(labels) == 1:
            label = labels.pop()
        else:
            raise RunnerError(f"group {name}: its topologies run on different runners ({', '.join(sorted(labels))})")
        if cpu_only and label != cpu:
            raise RunnerError(
                f"group {name} needs the runner {label!r}; a pull request from a fork runs on "
                f"{cpu!r} only (ask a maintainer to run it with /rerun-test)"
            )
        out.append({**entry, "runner": label})
    return {"include": out}
