"""sglang-style registered test files (``test/registered/``) and the map onto our topologies.

Upstream files declare where they run with ``register_*_ci(...)`` calls, read with :mod:`ast` only;
``topologies/_upstream-map.toml`` sends each to one of our topologies (unmapped: an error). Only CPU and
CUDA registrations concern us. Examples: docs/modules.md.
"""

from __future__ import annotations

import ast
import tomllib
from dataclasses import dataclass
from pathlib import Path

from harness.rerun.registry import DEFAULT_TEST_EST, RegistryError, SuiteFile, TestEntry, read_tests
from harness.topology import TOPOLOGY_DIR

MAP_FILE = TOPOLOGY_DIR / "_upstream-map.toml"
_BACKENDS = {"register_cpu_ci": "cpu", "register_cuda_ci": "cuda"}
_POSITIONAL = ("est_time", "suite", "nightly", "disabled")
_KEYWORDS = set(_POSITIONAL) | {"stage", "runner_config"}


@dataclass(frozen=True)
class Registration:
    """One ``register_*_ci`` call."""

    backend: str  # "cpu" | "cuda"
    est_time: float
    suite: str | None = None
    stage: str | None = None
    runner_config: str | None = None
    disabled: str | None = None

    @property
    def label(self) -> str:
        """The upstream suite name, as upstream spells it."""
        if self.stage and self.runner_config:
            return f"{self.stage}-test-{self.runner_config}"
        return self.suite or f"<{self.backend} without suite>"


@dataclass(frozen=True)
class UpstreamMap:
    """The parsed ``_upstream-map.toml``."""

    backend: dict[str, str]
    runner_config: dict[str, str]
    suite: dict[str, str]
    where: str = MAP_FILE.name

    def topology_for(self, reg: Registration) -> str:
        """Our topology for one registration.

        Raises:
            RegistryError: nothing in the map covers it (names the suite and the map file).
        """
        if reg.runner_config and reg.runner_config in self.runner_config:
            return self.runner_config[reg.runner_config]
        if reg.suite and reg.suite in self.suite:
            return self.suite[reg.suite]
        if reg.backend in self.backend:
            return self.backend[reg.backend]
        key = f'[runner_config] "{reg.runner_config}"' if reg.runner_config else f'[suite] "{reg.suite}"'
        raise RegistryError(
            f'unmapped upstream {reg.backend} suite {reg.label!r}; add {key} = "<topology>" to topologies/{self.where}'
        )


def load_map(path: Path = MAP_FILE) -> UpstreamMap:
    """Load the upstream map.

    Raises:
        RegistryError: missing file or wrong shape.
    """
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise RegistryError(
            f"{path.name}: missing; create topologies/{path.name} with [backend], [runner_config], [suite]"
        ) from None
    except tomllib.TOMLDecodeError as e:
        raise RegistryError(f"{path.name}: not valid TOML ({e}); fix the syntax") from None
    tables = {}
    for key in ("backend", "runner_config", "suite"):
        t = data.get(key, {})
        if not isinstance(t, dict) or not all(isinstance(v, str) for v in t.values()):
            raise RegistryError(f"{path.name}: [{key}] must map names to topology names")
        tables[key] = dict(t)
    unknown = sorted(set(data) - set(tables))
    if unknown:
        raise RegistryError(f"{path.name}: unknown table {unknown[0]!r}; use [backend], [runner_config] or [suite]")
    return UpstreamMap(where=path.name, **tables)


def _literal(node: ast.expr, what: str, where: str) -> object:
    if not isinstance(node, ast.Constant):
        raise RegistryError(f"{where}: {what} must be a literal; write it as a constant")
    return node.value


def read_registrations(tree: ast.Module, where: str) -> list[Registration]:
    """The module-level CPU/CUDA ``register_*_ci`` calls of a parsed file.

    Raises:
        RegistryError: a call has non-literal or unknown arguments.
    """
    regs = []
    for stmt in tree.body:
        call = stmt.value if isinstance(stmt, ast.Expr) else None
        if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Name) or call.func.id not in _BACKENDS:
            continue
        fn = call.func.id
        if len(call.args) > len(_POSITIONAL) or any(isinstance(a, ast.Starred) for a in call.args):
            raise RegistryError(f"{where}: {fn}() has unsupported positional arguments; use keywords")
        args = {name: _literal(a, f"{fn}({name}=…)", where) for name, a in zip(_POSITIONAL, call.args)}
        for kw in call.keywords:
            if kw.arg is None or kw.arg not in _KEYWORDS:
                raise RegistryError(
                    f"{where}: {fn}() has unknown argument {kw.arg!r}; use {', '.join(sorted(_KEYWORDS))}"
                )
            args[kw.arg] = _literal(kw.value, f"{fn}({kw.arg}=…)", where)
        est = args.get("est_time")
        if isinstance(est, bool) or not isinstance(est, (int, float)):
            raise RegistryError(f"{where}: {fn}() needs a numeric est_time")
        for k in ("suite", "stage", "runner_config", "disabled"):
            if args.get(k) is not None and not isinstance(args[k], str):
                raise RegistryError(f"{where}: {fn}({k}=…) must be a string")
        regs.append(
            Registration(
                backend=_BACKENDS[fn],
                est_time=float(est),
                suite=args.get("suite"),
                stage=args.get("stage"),
                runner_config=args.get("runner_config"),
                disabled=args.get("disabled"),
            )
        )
    return regs


def read_upstream(path: Path, rel: str, mapping: UpstreamMap) -> SuiteFile | None:
    """Read one upstream file.

    Args:
        path: the file.
        rel: display path / node-id prefix.
        mapping: the topology map.

    Returns:
        The :class:`SuiteFile` (``error`` set when its registration cannot be used), or None when the
        file registers nothing for CPU or CUDA.
    """
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    except (SyntaxError, UnicodeDecodeError) as e:
        return SuiteFile(
            path=path, rel=rel, tests=(), kind="upstream", error=f"{rel}: cannot be parsed ({e}); fix the file"
        )
    try:
        regs = read_registrations(tree, rel)
        if not regs:
            return None
        topologies: list[str] = []
        for r in regs:
            t = mapping.topology_for(r)
            if t not in topologies:
                topologies.append(t)
        raws, classes, _ = read_tests(tree, rel)
    except RegistryError as e:
        msg = str(e) if str(e).startswith(rel) else f"{rel}: {e}"
        return SuiteFile(path=path, rel=rel, tests=(), kind="upstream", error=msg)
    est = max(r.est_time for r in regs)
    share = est / len(raws) if raws else DEFAULT_TEST_EST
    tests = tuple(TestEntry(names=r.names, topologies=tuple(topologies), est_time=share) for r in raws)
    disabled = regs[0].disabled if all(r.disabled for r in regs) else None
    return SuiteFile(path=path, rel=rel, tests=tests, kind="upstream", classes=tuple(classes), disabled=disabled)
