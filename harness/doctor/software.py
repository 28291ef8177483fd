"""Software checks: python, torch, ray, sglang (and the transfer engine) identical on every node, and
sglang within the range the adapter supports.

What each node holds comes from :func:`harness.cluster.nodes.installed_versions` (package metadata;
the sglang version is the *target's*: ``--sglang`` / ``HARNESS_SGLANG``, the installed one by default,
read from its files by the adapter's resolver, which imports no sglang either).
"""

from __future__ import annotations

from typing import Callable

from harness.cluster.nodes import PACKAGES, NodeFacts, Versions, installed_versions, skew
from harness.doctor.result import CheckResult, Status
from harness.targets.sglang.releases import SUPPORTED_RANGE, release_refused

__all__ = ["REQUIRED", "SUPPORTED_RANGE", "check_driver", "check_versions", "installed_versions"]

#: Distributions that must be installed (the rest are reported when present; the network check
#: already fails when the topology's transfer backend cannot be imported).
REQUIRED = ("python", "torch", "ray", "sglang")


_FIX_SAME = (
    "install the same versions on every node: run `./dev install` from the same commit on each "
    "node, or use one container image for the whole cluster"
)


def check_versions(
    per_node: dict[str, Versions], refused: Callable[[str], "str | None"] = release_refused
) -> list[CheckResult]:
    """Compare versions across nodes and sglang against the adapter's supported range.

    Args:
        per_node: node label -> the versions a probe read there (several probes on one node must agree).
        refused: why a sglang version is outside the adapter's range (None: inside it).

    Returns:
        One ``software.<package>`` row per package (node ``all``) and one ``software.sglang_supported`` row.
    """
    rows: list[CheckResult] = []
    if not per_node:
        return [
            CheckResult(
                "software.versions",
                Status.FAILED,
                "no probe reported its versions",
                "see the placement and probe rows above",
                node="all",
            )
        ]
    for pkg in PACKAGES:
        seen = {node: v.get(pkg) for node, v in per_node.items()}
        distinct = set(seen.values())
        if distinct == {None}:
            if pkg in REQUIRED:
                rows.append(
                    CheckResult(
                        f"software.{pkg}",
                        Status.FAILED,
                        f"{pkg} is not installed on any node",
                        "run `./dev install` on every node",
                        node="all",
                    )
                )
            continue
        if len(distinct) == 1:
            rows.append(
                CheckResult(
                    f"software.{pkg}", Status.PASSED, f"{pkg} {distinct.pop()} on {len(seen)} node(s)", node="all"
                )
            )
            continue
        listed = "; ".join(f"{node}: {v or 'missing'}" for node, v in sorted(seen.items()))
        rows.append(
            CheckResult(
                f"software.{pkg}", Status.FAILED, f"{pkg} differs across nodes: {listed}", _FIX_SAME, node="all"
            )
        )
    bad = {
        node: v.get("sglang")
        for node, v in per_node.items()
        if v.get("sglang") is None or refused(str(v.get("sglang")))
    }
    if bad:
        listed = "; ".join(f"{node}: {v or 'missing'}" for node, v in sorted(bad.items()))
        rows.append(
            CheckResult(
                "software.sglang_supported",
                Status.FAILED,
                f"the adapter supports sglang {SUPPORTED_RANGE}; found {listed}",
                "install a supported sglang (./dev install) or pass --sglang 0.5.N|PATH",
                node="all",
            )
        )
    else:
        found = sorted({str(v.get("sglang")) for v in per_node.values()})
        rows.append(
            CheckResult(
                "software.sglang_supported",
                Status.PASSED,
                f"sglang {', '.join(found)} is within the adapter's range {SUPPORTED_RANGE}",
                node="all",
            )
        )
    return rows


def check_driver(nodes: list[NodeFacts]) -> list[CheckResult]:
    """Every node of a joined cluster against this machine (the driver): python, ray, sglang, torch.

    Args:
        nodes: :class:`~harness.cluster.nodes.NodeFacts` of every alive node (what they answered when joined).

    Returns:
        One ``software.driver`` row (node ``all``) naming each differing node and both versions.
    """
    problems = skew(nodes)
    if problems:
        return [
            CheckResult(
                "software.driver",
                Status.FAILED,
                "differs from this machine: " + "; ".join(problems),
                _FIX_SAME,
                node="all",
            )
        ]
    answered = sum(1 for n in nodes if not n.error)
    return [
        CheckResult(
            "software.driver",
            Status.PASSED,
            f"python, ray, sglang, torch on {answered} node(s) match this machine",
            node="all",
        )
    ]
