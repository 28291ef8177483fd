"""Gate files: typed, validated descriptions of what must pass before a build ships.

A gate file (``ci/gates/NAME.toml``) names the suites that must pass, where, how often, and the flaky
policy. Every problem is one :class:`GateError`: ``<file>: <key>: <problem>; <fix>``. Defaults live only
here. The file's shape, key by key: docs/modules.md.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

from harness import tomlcheck

#: Where the shipped gates live (the repository's ``ci/gates/``).
GATE_DIR = Path(__file__).resolve().parents[2] / "ci" / "gates"

#: Failure classes a flaky policy may rerun. Crashes, import errors, timeouts, accounting and other
#: assertion failures are deterministic evidence and are never rerun.
FLAKY_ELIGIBLE = ("accuracy", "timing")
ENGINES = ("all", "sim", "sglang-server")
DEFAULT_TIMEOUT = 1800.0
DEFAULT_MIN_PASS_RATE = 1.0
DEFAULT_RERUNS = 0
MAX_RERUNS = 10

_TOP_KEYS = {"name", "description", "sglang_version", "min_pass_rate", "timeout", "flaky", "seeds", "suites"}
_FLAKY_KEYS = {"reruns", "classes"}
_SEED_KEYS = {"hypothesis", "workload"}
# A relative directory: segments like rerun-test's spec paths (never an option, a dot file or "..").
_DIR_RE = re.compile(r"^(?:[A-Za-z0-9_][A-Za-z0-9_.\-]*/)+$")
#: A suite's name names a directory of the run: a plain name, never a path.
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}")
#: The longest timeout a gate or suite may set (a day), and the seeds' range (64-bit unsigned).
MAX_TIMEOUT_S = 86400.0
MAX_SEED = 2**64 - 1
_SUITE_KEYS = {"name", "select", "topologies", "required", "timeout", "min_pass_rate", "engine", "require"}


class GateError(ValueError):
    """A gate file is missing, malformed or inconsistent. One line: file, key, fix."""


@dataclass(frozen=True)
class FlakyPolicy:
    """How many times a flaky-classified failure is rerun, and which classes count as flaky."""

    reruns: int = DEFAULT_RERUNS
    classes: tuple[str, ...] = FLAKY_ELIGIBLE

    def may_rerun(self, failure_class: str, attempts: int) -> bool:
        """Whether a test that failed with ``failure_class`` after ``attempts`` runs gets another.

        Args:
            failure_class: from :func:`harness.gates.classify.classify`.
            attempts: runs so far (1 after the first).
        """
        return failure_class in self.classes and attempts <= self.reruns


@dataclass(frozen=True)
class GateSuite:
    """One ``[[suites]]`` entry: a selection with its own requirement, timeout and threshold."""

    name: str
    select: tuple[str, ...]
    required: bool = True
    topologies: tuple[str, ...] = ()
    timeout: float = DEFAULT_TIMEOUT
    min_pass_rate: float = DEFAULT_MIN_PASS_RATE
    engine: str | None = None
    require: tuple[str, ...] = ()

    def pytest_args(self) -> tuple[str, ...]:
        """Extra pytest arguments of this suite's groups."""
        return ("--engine", self.engine) if self.engine else ()


@dataclass(frozen=True)
class Gate:
    """A validated gate. Build it with :func:`load` or :func:`get`."""

    name: str
    suites: tuple[GateSuite, ...]
    description: str = ""
    sglang_version: str = ""
    min_pass_rate: float = DEFAULT_MIN_PASS_RATE
    timeout: float = DEFAULT_TIMEOUT
    flaky: FlakyPolicy = FlakyPolicy()
    hypothesis_seed: int | None = None
    workload_seed: int | None = None
    path: Path | None = field(default=None, compare=False)

    def suite(self, name: str) -> GateSuite:
        """The suite entry called ``name`` (KeyError if none)."""
        for s in self.suites:
            if s.name == name:
                return s
        raise KeyError(name)

    def summary(self) -> dict[str, Any]:
        """A JSON-able view (``harness gate show``)."""
        return {
            "name": self.name,
            "description": self.description,
            "sglang_version": self.sglang_version,
            "min_pass_rate": self.min_pass_rate,
            "timeout": self.timeout,
            "flaky": {"reruns": self.flaky.reruns, "classes": list(self.flaky.classes)},
            "seeds": {"hypothesis": self.hypothesis_seed, "workload": self.workload_seed},
            "suites": [
                {
                    "name": s.name,
                    "select": list(s.select),
                    "required": s.required,
                    "topologies": list(s.topologies),
                    "timeout": s.timeout,
                    "min_pass_rate": s.min_pass_rate,
                    "engine": s.engine,
                    "require": list(s.require),
                }
                for s in self.suites
            ],
        }


# --------------------------------------------------------------------------------------------
# validation
# --------------------------------------------------------------------------------------------


_fail = partial(tomlcheck.fail, GateError)
_take = partial(tomlcheck.take, GateError)
_check_unknown = partial(tomlcheck.check_unknown, GateError)


def _strings(table: dict[str, Any], key: str, where: str, ctx: str, default: tuple[str, ...] = ()) -> tuple[str, ...]:
    values = _take(table, key, list, list(default), where, ctx)
    if not all(isinstance(v, str) and v for v in values):
        raise _fail(where, f"{ctx}{key}", "must be a list of non-empty strings", f'write e.g. {ctx}{key} = ["..."]')
    return tuple(values)


def _rate(table: dict[str, Any], where: str, ctx: str, default: float) -> float:
    rate = float(_take(table, "min_pass_rate", (int, float), default, where, ctx))
    if not 0.0 < rate <= 1.0:
        raise _fail(
            where, f"{ctx}min_pass_rate", f"must be in (0, 1], got {rate:g}", "use a fraction such as 1.0 or 0.95"
        )
    return rate


def _timeout(table: dict[str, Any], where: str, ctx: str, default: float) -> float:
    t = float(_take(table, "timeout", (int, float), default, where, ctx))
    if t <= 0:
        raise _fail(
            where, f"{ctx}timeout", f"must be > 0 seconds, got {t:g}", "set it to the suite's worst-case seconds"
        )
    return tomlcheck.number(
        GateError, t, where, f"{ctx}timeout", 0, MAX_TIMEOUT_S, "set it to the suite's worst-case seconds"
    )


def _parse_select(values: tuple[str, ...], where: str, ctx: str) -> tuple[str, ...]:
    from harness.rerun import spec_grammar as spec_mod  # the same grammar rerun-test accepts

    if not values:
        raise _fail(where, f"{ctx}select", "is empty or missing", 'name what to run, e.g. select = ["suites/unit/"]')
    for v in values:
        if v.endswith("/"):
            if not _DIR_RE.match(v) or ".." in v.split("/"):
                raise _fail(
                    where,
                    f"{ctx}select",
                    f"{v!r} is not a directory inside the repository",
                    'use a relative directory such as "suites/unit/"',
                )
            continue
        try:
            spec_mod.parse_spec(v)
        except spec_mod.SpecError as e:
            raise _fail(where, f"{ctx}select", str(e), "use rerun-test specs or a directory ending in '/'") from None
    return values


def _parse_suite(
    i: int, table: Any, where: str, gate_timeout: float, gate_rate: float, topo_names: list[str]
) -> GateSuite:
    ctx = f"suites[{i}]."
    if not isinstance(table, dict):
        raise _fail(where, f"suites[{i}]", "must be a table", "write each entry as [[suites]]")
    _check_unknown(table, _SUITE_KEYS, where, ctx)
    name = _take(table, "name", str, "", where, ctx)
    if not name:
        raise _fail(where, f"{ctx}name", "is missing", 'give the entry a name, e.g. name = "unit"')
    if not _NAME_RE.fullmatch(name):  # it names a directory of the run
        raise _fail(
            where,
            f"{ctx}name",
            f"{name!r} is not a plain name",
            "use letters, digits, '-', '_' and '.', starting with a letter or digit, at most 64",
        )
    topologies = _strings(table, "topologies", where, ctx)
    for t in topologies:
        if topo_names and t not in topo_names:
            raise _fail(where, f"{ctx}topologies", f"unknown topology {t!r}", f"use one of: {', '.join(topo_names)}")
    engine = _take(table, "engine", str, None, where, ctx)
    if engine is not None and engine not in ENGINES:
        raise _fail(where, f"{ctx}engine", f"unknown engine {engine!r}", f"use one of: {', '.join(ENGINES)}")
    require = _strings(table, "require", where, ctx)
    for r in require:
        if not r.startswith("suites/") or ".py" not in r:
            raise _fail(
                where,
                f"{ctx}require",
                f"{r!r} is not a test of the repository",
                'name tests by node id or file, e.g. "suites/disaggregation/test_x.py::test_y"',
            )
    return GateSuite(
        name=name,
        select=_parse_select(_strings(table, "select", where, ctx), where, ctx),
        required=_take(table, "required", bool, True, where, ctx),
        topologies=topologies,
        timeout=_timeout(table, where, ctx, gate_timeout),
        min_pass_rate=_rate(table, where, ctx, gate_rate),
        engine=engine,
        require=require,
    )


def _parse_flaky(table: Any, where: str) -> FlakyPolicy:
    if table is None:
        return FlakyPolicy()
    if not isinstance(table, dict):
        raise _fail(where, "flaky", "must be a table", "write it as [flaky]")
    _check_unknown(table, _FLAKY_KEYS, where, "flaky.")
    reruns = _take(table, "reruns", int, DEFAULT_RERUNS, where, "flaky.")
    if not 0 <= reruns <= MAX_RERUNS:
        raise _fail(
            where,
            "flaky.reruns",
            f"must be in 0..{MAX_RERUNS}, got {reruns}",
            "rerun a flaky failure a few times at most",
        )
    classes = _strings(table, "classes", where, "flaky.", FLAKY_ELIGIBLE)
    for c in classes:
        if c not in FLAKY_ELIGIBLE:
            raise _fail(
                where,
                "flaky.classes",
                f"{c!r} failures are never rerun (only {', '.join(FLAKY_ELIGIBLE)} are flaky)",
                f"keep only {', '.join(FLAKY_ELIGIBLE)}",
            )
    return FlakyPolicy(reruns=reruns, classes=classes)


def _parse_seeds(table: Any, where: str) -> tuple[int | None, int | None]:
    if table is None:
        return None, None
    if not isinstance(table, dict):
        raise _fail(where, "seeds", "must be a table", "write it as [seeds]")
    _check_unknown(table, _SEED_KEYS, where, "seeds.")
    out = []
    for key in ("hypothesis", "workload"):
        v = _take(table, key, int, None, where, "seeds.")
        if v is not None and not 0 <= v <= MAX_SEED:
            raise _fail(where, f"seeds.{key}", f"must be from 0 to 2**64-1, got {v}", "use a non-negative integer")
        out.append(v)
    return out[0], out[1]


def parse(data: dict[str, Any], where: str, topo_names: list[str] | None = None) -> Gate:
    """Validate a parsed gate table.

    Args:
        data: the TOML document.
        where: the file name for messages.
        topo_names: known topology names (None: the shipped ones).

    Returns:
        The :class:`Gate`.

    Raises:
        GateError: anything wrong, naming the key and the fix.
    """
    from harness import topology

    if topo_names is None:
        topo_names = topology.names()
    _check_unknown(data, _TOP_KEYS, where, "")
    name = _take(data, "name", str, "", where, "")
    if not name:
        raise _fail(where, "name", "is missing", 'add name = "<the file name without .toml>"')
    version = _take(data, "sglang_version", str, "", where, "")
    rate = _rate(data, where, "", DEFAULT_MIN_PASS_RATE)
    timeout = _timeout(data, where, "", DEFAULT_TIMEOUT)
    suites_raw = _take(data, "suites", list, [], where, "")
    if not suites_raw:
        raise _fail(where, "suites", "no [[suites]] entries", "add at least one [[suites]] with name and select")
    suites = tuple(_parse_suite(i, t, where, timeout, rate, topo_names) for i, t in enumerate(suites_raw))
    seen: set[str] = set()
    for i, s in enumerate(suites):
        if s.name in seen:
            raise _fail(where, f"suites[{i}].name", f"duplicate suite name {s.name!r}", "give every entry its own name")
        seen.add(s.name)
    hyp, work = _parse_seeds(data.get("seeds"), where)
    return Gate(
        name=name,
        suites=suites,
        description=_take(data, "description", str, "", where, ""),
        sglang_version=version,
        min_pass_rate=rate,
        timeout=timeout,
        flaky=_parse_flaky(data.get("flaky"), where),
        hypothesis_seed=hyp,
        workload_seed=work,
    )


def load(path: str | Path, topo_names: list[str] | None = None) -> Gate:
    """Load and validate one gate file.

    Raises:
        GateError: missing file, bad TOML, or invalid content; ``name`` must match the file name.
    """
    p = Path(path)
    where = p.name
    data = tomlcheck.read(GateError, p, "gate", "harness gate list")
    gate = parse(data, where, topo_names)
    if gate.name != p.stem:
        raise _fail(
            where, "name", f"{gate.name!r} differs from the file name", f'set name = "{p.stem}" or rename the file'
        )
    return replace(gate, path=p.resolve())


def names(directory: Path = GATE_DIR) -> list[str]:
    """Shipped gate names (``*.toml`` in ``directory`` not starting with ``_``), sorted."""
    return tomlcheck.names(directory)


def get(name_or_path: str | Path, directory: Path = GATE_DIR) -> Gate:
    """A gate by name (``ci/gates/NAME.toml``) or by path to a ``.toml`` file.

    Raises:
        GateError: unknown name (listing the known ones) or an invalid file.
    """
    return load(tomlcheck.find(GateError, "gate", name_or_path, directory))
