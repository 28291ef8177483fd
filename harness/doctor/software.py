"""Software checks: python, torch, ray, sglang (and the transfer engine) identical on every node, and
sglang within the range the adapter supports.

Versions come from package metadata (``importlib.metadata``): reading them imports nothing, so a
probe never pays torch's or sglang's import time, and a broken install still reports its version.
The sglang version is the *target's* (``--sglang`` / ``HARNESS_SGLANG``; the installed one by
default), read from its files by the adapter's resolver, which imports no sglang either.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import platform
from pathlib import Path
from typing import Callable

from harness.doctor.result import CheckResult, Status

_SGLANG_ENV = "HARNESS_SGLANG"  # harness.targets.sglang.selection.ENV_VAR

def _adapter_range() -> tuple[str, Callable[[str], "str | None"]]:
    # The adapter's compat module reads no sglang at import, so doctor can ask it directly.
    from harness.targets.sglang import compat

    return compat.SUPPORTED_RANGE, compat.release_refused


SUPPORTED_RANGE, _release_refused = _adapter_range()

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
        if name == "sglang":
            found = _sglang_tree_version()
            if found is not None:  # the tree this interpreter imports, not whatever metadata lies beside it
                out[name] = found
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


def _sglang_tree_version() -> str | None:
    """The version of the sglang this interpreter runs: the selected target (``$HARNESS_SGLANG``), else
    the tree an import would find (its own version file), else None (metadata decides)."""
    from harness.targets.sglang import selection as target

    if os.environ.get(_SGLANG_ENV):
        return target.current().version  # the target under test, not the venv's install
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        return None
    from harness.targets.sglang.version import UNKNOWN, read_version

    found = read_version(Path(list(spec.submodule_search_locations)[0]).resolve().parent)
    return None if found == UNKNOWN else found


_FIX_SAME = ("install the same versions on every node: run `./dev install` from the same commit on each "
             "node, or use one container image for the whole cluster")


def check_versions(per_node: dict[str, Versions],
                   refused: Callable[[str], "str | None"] = _release_refused) -> list[CheckResult]:
    """Compare versions across nodes and sglang against the adapter's supported range.

    Args:
        per_node: node label -> the versions a probe read there (several probes on one node must agree).
        refused: why a sglang version is outside the adapter's range (None: inside it).

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
    bad = {node: v.get("sglang") for node, v in per_node.items()
           if v.get("sglang") is None or refused(str(v.get("sglang")))}
    if bad:
        listed = "; ".join(f"{node}: {v or 'missing'}" for node, v in sorted(bad.items()))
        rows.append(CheckResult("software.sglang_supported", Status.FAILED,
                                f"the adapter supports sglang {SUPPORTED_RANGE}; found {listed}",
                                f"install a supported sglang (./dev install) or pass --sglang 0.5.N|PATH",
                                node="all"))
    else:
        found = sorted({str(v.get("sglang")) for v in per_node.values()})
        rows.append(CheckResult("software.sglang_supported", Status.PASSED,
                                f"sglang {', '.join(found)} is within the adapter's range {SUPPORTED_RANGE}", node="all"))
    return rows


def check_driver(nodes: list) -> list[CheckResult]:
    """Every node of a joined cluster against this machine (the driver): python, ray, sglang, torch.

    Args:
        nodes: :class:`harness.cluster.join.NodeFacts` of every alive node (what they answered when joined).

    Returns:
        One ``software.driver`` row (node ``all``) naming each differing node and both versions.
    """
    from harness.cluster.join import skew

    problems = skew(nodes)
    if problems:
        return [CheckResult("software.driver", Status.FAILED, "differs from this machine: " + "; ".join(problems), _FIX_SAME,
                            node="all")]
    answered = sum(1 for n in nodes if not n.error)
    return [CheckResult("software.driver", Status.PASSED,
                        f"python, ray, sglang, torch on {answered} node(s) match this machine", node="all")]
