"""Repro bundles: everything needed to rerun one failing test anywhere, as one ``repro.json``.

Fields (``version`` 1)::

    spec            the test's node id, also a rerun-test spec (suites/x/test_a.py::TestC::test_y[p])
    gate, suite     where it failed
    topology        the group's topology; ``simulated``: whether its GPUs were Ray logical GPUs
    engine          the pytest --engine of the suite (null: the default)
    seeds           hypothesis (--hypothesis-seed), workload_base (--workload-seed), workload (derived per test)
    engine_args     per topology role, the engine arguments it declares
    environment     what matters for reproduction (:func:`environment`)
    sglang_version, git_sha
    sglang          the sglang target the failure ran on (version, origin, root, commit, dirty)
    failure         class, outcome, message, attempts
    workers         the workers the test owned; ``files``: their logs/ledgers copied next to the bundle
    ledger_excerpt  per worker: broken ledger invariants and the last events

Pure except :func:`environment` (reads this process's environment) and :func:`load` / :func:`write`.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
from pathlib import Path
from typing import Any

VERSION = 1
#: Environment variables that change what a test does (prefixes); anything else is noise.
ENV_PREFIXES = ("HARNESS_", "SGLANG_", "CUDA_", "NCCL_", "TORCH_", "RAY_", "PYTHONHASHSEED", "OMP_NUM_THREADS")
#: Variables that differ on every run or machine without changing behaviour.
ENV_IGNORED = ("HARNESS_RERUN_PROGRESS", "RAY_ADDRESS")
PACKAGES = ("sglang", "torch", "ray", "hypothesis", "pytest")
REQUIRED = ("version", "spec", "topology", "seeds")


class ReproError(ValueError):
    """A repro bundle cannot be read or used. One line: file, problem, fix."""


def package_version(name: str) -> str | None:
    """Installed version of a distribution, without importing it (None: not installed)."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment(env: dict[str, str] | None = None) -> dict[str, Any]:
    """The facts of this machine that matter for reproducing a failure.

    Args:
        env: environment variables (default ``os.environ``).

    Returns:
        ``python``, ``platform``, ``packages`` (name → version), ``env`` (the relevant variables).
    """
    env = dict(os.environ if env is None else env)
    relevant = {k: v for k, v in sorted(env.items()) if k.startswith(ENV_PREFIXES) and k not in ENV_IGNORED}
    return {
        "python": platform.python_version(),
        "platform": f"{platform.system()}-{platform.machine()}",
        "packages": {p: package_version(p) for p in PACKAGES},
        "env": relevant,
    }


def env_differences(recorded: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """What differs between the environment of the failure and this one (pure).

    Returns:
        One line per difference, e.g. ``packages.torch: 2.14.1 → 2.15.0``; empty when nothing matters.
    """
    out = []
    for key in ("python", "platform"):
        if recorded.get(key) != current.get(key):
            out.append(f"{key}: {recorded.get(key)} → {current.get(key)}")
    for section in ("packages", "env"):
        a, b = recorded.get(section) or {}, current.get(section) or {}
        for k in sorted(set(a) | set(b)):
            if a.get(k) != b.get(k):
                out.append(f"{section}.{k}: {a.get(k, '(unset)')} → {b.get(k, '(unset)')}")
    return out


def bundle(*, spec: str, gate: str, suite: str, topology: str, simulated: bool, engine: str | None,
           hypothesis_seed: int, workload_base: int, workload_seed: int, engine_args: dict[str, list[str]],
           env: dict[str, Any], sglang_version: str | None, git_sha: str, failure: dict[str, Any],
           workers: list[str], files: list[str], ledger_excerpt: dict[str, Any],
           sglang: dict[str, Any] | None = None) -> dict[str, Any]:
    """The bundle as a JSON-able dict (pure; see the module docstring for the fields). ``sglang`` is
    the target description (``Target.to_dict()``) ``rerun-test --from`` reruns on."""
    return {
        "sglang": sglang,
        "version": VERSION,
        "spec": spec,
        "gate": gate,
        "suite": suite,
        "topology": topology,
        "simulated": simulated,
        "engine": engine,
        "seeds": {"hypothesis": hypothesis_seed, "workload_base": workload_base, "workload": workload_seed},
        "engine_args": engine_args,
        "environment": env,
        "sglang_version": sglang_version,
        "git_sha": git_sha,
        "failure": failure,
        "workers": workers,
        "files": files,
        "ledger_excerpt": ledger_excerpt,
        "rerun": "rerun-test --from repro.json",
    }


def write(path: Path, data: dict[str, Any]) -> Path:
    """Write a bundle (creating its directory)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return path


def load(path: Path) -> dict[str, Any]:
    """Read and check a bundle.

    Raises:
        ReproError: missing, not JSON, another version, or a required field missing.
    """
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ReproError(f"{path}: file not found; pass the repro.json a gate run wrote (under report/failures/)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ReproError(f"{path}: not JSON ({e}); pass a repro.json written by `harness gate run`") from None
    if not isinstance(data, dict):
        raise ReproError(f"{path}: not a repro bundle; pass a repro.json written by `harness gate run`")
    missing = [k for k in REQUIRED if k not in data]
    if missing:
        raise ReproError(f"{path}: missing {', '.join(missing)}; pass a repro.json written by `harness gate run`")
    if data["version"] != VERSION:
        raise ReproError(f"{path}: bundle version {data['version']!r}, this harness reads {VERSION}; rerun the gate with this harness")
    seeds = data["seeds"]
    if not isinstance(seeds, dict) or not all(isinstance(seeds.get(k), int) for k in ("hypothesis", "workload_base")):
        raise ReproError(f"{path}: seeds.hypothesis and seeds.workload_base must be integers; fix the bundle")
    return data

