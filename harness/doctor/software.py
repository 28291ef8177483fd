"""Software checks: python, torch, ray, sglang (and the transfer engine) identical on every node, and
sglang the one release the adapter supports.

Versions come from package metadata (``importlib.metadata``): reading them imports nothing, so a
probe never pays torch's or sglang's import time, and a broken install still reports its version.
"""

from __future__ import annotations

import ast
import importlib.metadata
import platform
from pathlib import Path
from typing import Callable

from harness.doctor.result import CheckResult, Status

_ADAPTER_VERSION_FILE = Path(__file__).resolve().parent.parent / "targets" / "sglang" / "version.py"


def adapter_supported_version(path: Path = _ADAPTER_VERSION_FILE) -> str:
    """The sglang version the adapter supports (``SUPPORTED_VERSION`` in its ``version.py``).

    Read from the source, not imported: importing anything under ``harness.targets.sglang`` runs the
    adapter's import-time version check, which raises on exactly the mismatch doctor must report.

    Raises:
        RuntimeError: the file has no literal ``SUPPORTED_VERSION = "..."``.
    """
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "SUPPORTED_VERSION" for t in node.targets):
            return str(ast.literal_eval(node.value))
    raise RuntimeError(f"{path}: no SUPPORTED_VERSION = \"...\" found")


SUPPORTED_VERSION = adapter_supported_version()

#: What is compared across nodes, in table order: name -> the distributions that provide it (the
#: first installed one counts; "python" is the interpreter itself).
PACKAGES: dict[str, tuple[str, ...]] = {
    "python": (),
    "torch": ("torch",),
    "ray": ("ray",),
    "sglang": ("sglang",),
    "mooncake": ("mooncake-transfer-engine", "mooncake-transfer-engine-non-cuda"),
}
#: Distributions that must be installed (the rest are reported when present; the network check
#: already fails when the topology's transfer backend cannot be imported).
REQUIRED = ("python", "torch", "ray", "sglang")

Versions = dict[str, "str | None"]


def installed_versions(version_of: Callable[[str], str] = importlib.metadata.version) -> Versions:
    """The versions of :data:`PACKAGES` in this interpreter (None: not installed), from metadata.

    Args:
        version_of: the metadata reader (``importlib.metadata.version``; tests pass a dict's getter).

    Returns:
        package name -> version or None.
    """
    out: Versions = {"python": platform.python_version()}
    for name, dists in PACKAGES.items():
        if not dists:
            continue
        out[name] = None
        for dist in dists:
            try:
                version = version_of(dist)
            except importlib.metadata.PackageNotFoundError:
                continue
            # Which distribution provides it matters too (the CUDA and non-CUDA mooncake builds differ).
            out[name] = version if dist == name else f"{version} ({dist})"
            break
    return out


_FIX_SAME = ("install the same versions on every node: run `./dev install` from the same commit on each "
             "node, or use one container image for the whole cluster")


def check_versions(per_node: dict[str, Versions], supported_sglang: str = SUPPORTED_VERSION) -> list[CheckResult]:
    """Compare versions across nodes and sglang against the adapter's pin.

    Args:
        per_node: node label -> the versions a probe read there (several probes on one node must agree).
        supported_sglang: the adapter's supported sglang version.

    Returns:
        One ``software.<package>`` row per package (node ``all``) and one ``software.sglang_supported`` row.
    """
    rows: list[CheckResult] = []
    if not per_node:
        return [CheckResult("software.versions", Status.FAILED, "no probe reported its versions",
                            "see the placement and probe rows above", node="all")]
    for pkg in PACKAGES:
        seen = {node: v.get(pkg) for node, v in per_node.items()}
        distinct = set(seen.values())
        if distinct == {None}:
            if pkg in REQUIRED:
                rows.append(CheckResult(f"software.{pkg}", Status.FAILED, f"{pkg} is not installed on any node",
                                        "run `./dev install` on every node", node="all"))
            continue
        if len(distinct) == 1:
            rows.append(CheckResult(f"software.{pkg}", Status.PASSED, f"{pkg} {distinct.pop()} on {len(seen)} node(s)", node="all"))
            continue
        listed = "; ".join(f"{node}: {v or 'missing'}" for node, v in sorted(seen.items()))
        rows.append(CheckResult(f"software.{pkg}", Status.FAILED, f"{pkg} differs across nodes: {listed}", _FIX_SAME, node="all"))
    bad = {node: v.get("sglang") for node, v in per_node.items() if v.get("sglang") != supported_sglang}
    if bad:
        listed = "; ".join(f"{node}: {v or 'missing'}" for node, v in sorted(bad.items()))
        rows.append(CheckResult("software.sglang_supported", Status.FAILED,
                                f"the adapter supports only sglang {supported_sglang}; found {listed}",
                                f"install sglang=={supported_sglang} (./dev install; requirements/sglang-cpu.txt pins it)",
                                node="all"))
    else:
        rows.append(CheckResult("software.sglang_supported", Status.PASSED,
                                f"sglang {supported_sglang} is the adapter's supported version", node="all"))
    return rows


def check_driver(nodes: list) -> list[CheckResult]:
    """Every node of a joined cluster against this machine (the driver): python, ray, sglang, torch.

    Args:
        nodes: :class:`harness.join.NodeFacts` of every alive node (what they answered when joined).

    Returns:
        One ``software.driver`` row (node ``all``) naming each differing node and both versions.
    """
    from harness.join import skew

    problems = skew(nodes)
    if problems:
        return [CheckResult("software.driver", Status.FAILED, "differs from this machine: " + "; ".join(problems), _FIX_SAME,
                            node="all")]
    answered = sum(1 for n in nodes if not n.error)
    return [CheckResult("software.driver", Status.PASSED,
                        f"python, ray, sglang, torch on {answered} node(s) match this machine", node="all")]
