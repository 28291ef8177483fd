"""Which environment a client must share with a fork server to be forked from it.

Modules read some environment at import, so a fork carries what the preload imported under the server's
values. :class:`EnvReads` records what the preload read; :func:`write_match` writes the values a client
must have beside the server's socket, where the client and the server compare them. More: docs/modules.md.
"""

from __future__ import annotations

import json
import os
import sys
from types import FrameType
from typing import Mapping, Sequence

from harness.workers.forkserver.client import MATCH_FILE


class EnvReads:
    """Records the names of the env vars Python code reads (``os.environ[k]``, ``.get``, ``in``,
    ``os.getenv``) while it is active, except reads by modules of the ``skip`` packages (imported
    afresh by each child, so what they read here does not matter).

    Code that scans the environment (iterates it, copies it) reads every variable from one place;
    such a place (one that read only variables that are set, and more than half of them) is a scan,
    not a read of each (a helper that reads many names also reads unset ones):
    :data:`SCANNED_PREFIXES` names the families the preloads scan for (tqdm's ``TQDM_``, networkx's,
    fsspec's); ``wsgiref`` keeps a copy of the whole environment for CGI, which the harness never runs.
    """

    def __init__(self, skip: Sequence[str] = ()) -> None:
        self.by_place: dict[tuple[str, int], set[str]] = {}
        self.skip = frozenset(skip)

    def names(self, before: Mapping[str, str]) -> set[str]:
        """The variables read, scans left out (``before``: the environment when recording began;
        a scan may also see what the recorded code set since)."""
        were_set = set(before) | set(os.environ)

        def is_scan(keys: set[str]) -> bool:
            return len(keys) > len(before) // 2 and keys <= were_set

        return {k for keys in self.by_place.values() if not is_scan(keys) for k in keys}

    def _record(self, key: str) -> None:
        frame: FrameType | None = sys._getframe(2)
        while frame is not None and (
            frame.f_globals.get("__name__") in ("os", "_collections_abc") or frame.f_globals is globals()
        ):  # past os, the ABCs and these wrappers
            frame = frame.f_back
        if frame is None:
            return
        if str(frame.f_globals.get("__name__", "")).split(".")[0] in self.skip:
            return
        self.by_place.setdefault((frame.f_code.co_filename, frame.f_lineno), set()).add(key)

    def __enter__(self) -> "EnvReads":
        cls = type(os.environ)
        self._saved = (cls.__getitem__, cls.__contains__)
        getitem, contains = self._saved
        record = self._record

        def recorded_getitem(env, key):
            record(key)
            return getitem(env, key)

        def recorded_contains(env, key):
            record(key)
            return contains(env, key)

        cls.__getitem__, cls.__contains__ = recorded_getitem, recorded_contains  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc) -> None:
        cls = type(os.environ)
        cls.__getitem__, cls.__contains__ = self._saved  # type: ignore[method-assign]


#: Env families read where Python code cannot see it (the interpreter at start, native libraries
#: when they load: OpenMP, BLAS, the allocator, torch's C++ side) or by preloaded modules that scan
#: the environment by prefix (tqdm, networkx, fsspec): with ``record_env``, every variable of these
#: families must be equal (or absent) on both sides.
SCANNED_PREFIXES: tuple[str, ...] = (
    "PYTHON",
    "OMP_",
    "KMP_",
    "GOMP_",
    "MKL_",
    "OPENBLAS_",
    "GOTO_",
    "BLIS_",
    "LD_",
    "MALLOC_",
    "CUDA_",
    "TORCH_",
    "PYTORCH_",
    "TQDM_",
    "NETWORKX_",
    "FSSPEC_",
)


#: Variables of those families read only when used, by the child itself (``breakpoint()`` reads
#: ``PYTHONBREAKPOINT`` at each call; a Ray driver sets it): never compared.
READ_WHEN_USED: tuple[str, ...] = ("PYTHONBREAKPOINT",)


def write_match(
    path: str,
    names: Sequence[str],
    prefixes: Sequence[str],
    env: Mapping[str, str],
    preload: str = "",
    set_by_preload: Mapping[str, str] | None = None,
    free_path: Mapping[str, object] | None = None,
) -> None:
    """Write :data:`MATCH_FILE` beside the socket ``path``: the values in ``env`` (``""``: unset) of
    ``names`` and of every variable of ``prefixes`` (but :data:`READ_WHEN_USED`), and the values the
    preload itself set: a client that already has those (its parent imported the same modules) is
    where a fresh interpreter would be after the same imports. ``free_path`` (:func:`free_path`):
    ``PYTHONPATH`` is compared by what it can change, not by its value."""
    match = {
        "env": {k: env.get(k, "") for k in sorted(set(names)) if k not in READ_WHEN_USED},
        "prefixes": {
            p: {k: v for k, v in env.items() if k.startswith(p) and k not in READ_WHEN_USED} for p in prefixes
        },
        "ignore": list(READ_WHEN_USED),
        "set_by_preload": dict(set_by_preload or {}),
        "preload": preload,
        "pid": os.getpid(),
    }
    if free_path is not None:
        match["free_path"] = dict(free_path)
    tmp = os.path.join(os.path.dirname(path), f".{MATCH_FILE}.tmp")
    with open(tmp, "w") as f:
        json.dump(match, f)
    os.replace(tmp, os.path.join(os.path.dirname(path), MATCH_FILE))


#: Modules a fresh interpreter imports at start from its own path, which a child imports again from
#: its own (:func:`harness.workers.forkserver.child.run_child`): never a reason to refuse a client.
RERUN_AT_START = ("sitecustomize", "usercustomize")


def free_path(pythonpath: str, modules: Mapping[str, object]) -> dict[str, object] | None:
    """What a server whose children rebuild ``sys.path`` from their own ``PYTHONPATH`` records so a
    client with another ``PYTHONPATH`` can still be forked (``None`` when it cannot: the preload
    imported a module from one of the server's own ``PYTHONPATH`` directories, which a client
    without that directory would not have).

    Returns ``{"pythonpath": the server's value, "tops": the top-level names the preload imported}``:
    a client's extra directory that holds none of ``tops`` (a scratch copy of ``sglang/``, the
    harness's ``sitecustomize`` directory) changes no module the children already have; one that
    holds one of them (a release's own pinned ``transformers``) would shadow it, and is refused.
    """
    entries = [os.path.abspath(p) for p in pythonpath.split(os.pathsep) if p]
    tops = set()
    for name, module in list(modules.items()):
        top = name.partition(".")[0]
        if top in RERUN_AT_START:
            continue
        if top in sys.stdlib_module_names or top.startswith("_") and top[1:] in sys.stdlib_module_names:
            continue
        tops.add(top)
        origin = getattr(module, "__file__", None)
        if origin and any(os.path.abspath(origin).startswith(e + os.sep) for e in entries):
            return None
    return {"pythonpath": pythonpath, "tops": sorted(tops)}
