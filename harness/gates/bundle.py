"""Repro bundles: everything needed to rerun one failing test anywhere, as one ``repro.json``.

A bundle names the test, where and on what it failed (gate, topology, engine, seeds, sglang target,
environment), the failure, and the workers' files and ledger excerpts. Pure except :func:`environment`,
:func:`load` and :func:`write`. The fields of version 1: docs/modules.md.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import re
from pathlib import Path
from typing import Any

from harness import atomic
from harness.targets.sglang.resolve import RELEASE as RELEASE_SPEC

VERSION = 1
#: Environment variables that change what a test does (prefixes); anything else is noise.
ENV_PREFIXES = ("HARNESS_", "SGLANG_", "CUDA_", "NCCL_", "TORCH_", "RAY_", "PYTHONHASHSEED", "OMP_NUM_THREADS")
#: Variables that differ on every run or machine without changing behaviour.
ENV_IGNORED = ("HARNESS_RERUN_PROGRESS", "RAY_ADDRESS")
PACKAGES = ("sglang", "torch", "ray", "hypothesis", "pytest")
REQUIRED = ("version", "spec", "topology", "seeds")
#: A variable whose name says it holds a secret is recorded as present, never by value.
SECRET_NAME = re.compile(r"(TOKEN|SECRET|PASSWORD|PASSWD|KEY|CREDENTIALS?)(_PATH|_FILE)?$", re.IGNORECASE)
#: What a secret's value is recorded as.
PRESENT = "<present>"
#: Ray's token file (``RAY_AUTH_TOKEN_PATH``, default ``~/.ray/auth_token``): recorded as present or absent.
RAY_TOKEN_FILE = "ray_token_file"
#: Longest string field a bundle may carry, and the seeds' range (a seed is a 64-bit unsigned integer).
MAX_FIELD = 4096
MAX_SEED = 2**64 - 1


class ReproError(ValueError):
    """A repro bundle cannot be read or used. One line: file, problem, fix."""


def package_version(name: str) -> str | None:
    """Installed version of a distribution, without importing it (None: not installed)."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def is_secret(name: str) -> bool:
    """Whether a variable's name says it holds a secret (its value is never recorded or printed).

    >>> [is_secret(n) for n in ("RAY_AUTH_TOKEN", "SGLANG_API_KEY", "HARNESS_SGLANG", "OMP_NUM_THREADS")]
    [True, True, False, False]
    >>> is_secret("SGLANG_TWO_STREAM_MAX_TOKENS"), is_secret("RAY_AUTH_TOKEN_PATH")  # a tuning value; a secret's file
    (False, True)
    """
    return bool(SECRET_NAME.search(name))


def ray_token_file(env: dict[str, str]) -> Path:
    """Where Ray reads its auth token from when ``RAY_AUTH_TOKEN`` is unset."""
    return Path(env.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")


def environment(env: dict[str, str] | None = None) -> dict[str, Any]:
    """The facts of this machine that matter for reproducing a failure; a secret only as :data:`PRESENT`.

    Args:
        env: environment variables (default ``os.environ``).

    Returns:
        ``python``, ``platform``, ``packages`` (name → version), ``env`` (the relevant variables, each secret
        one as :data:`PRESENT`) and ``secrets`` (Ray's token file: ``present`` or ``absent``).
    """
    env = dict(os.environ if env is None else env)
    relevant = {
        k: (PRESENT if is_secret(k) else v)
        for k, v in sorted(env.items())
        if k.startswith(ENV_PREFIXES) and k not in ENV_IGNORED
    }
    return {
        "python": platform.python_version(),
        "platform": f"{platform.system()}-{platform.machine()}",
        "packages": {p: package_version(p) for p in PACKAGES},
        "env": relevant,
        "secrets": {RAY_TOKEN_FILE: "present" if ray_token_file(env).is_file() else "absent"},
    }


def env_differences(recorded: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """What differs between the environment of the failure and this one (pure).

    Returns:
        One line per difference, e.g. ``packages.torch: 2.14.1 → 2.15.0``; empty when nothing matters. A
        secret is compared by presence only, and its value is never in a line (an older bundle may hold one).
    """
    out = []
    for key in ("python", "platform"):
        if recorded.get(key) != current.get(key):
            out.append(f"{key}: {recorded.get(key)} → {current.get(key)}")
    for section in ("packages", "env", "secrets"):
        a, b = recorded.get(section) or {}, current.get(section) or {}
        if not isinstance(a, dict) or not isinstance(b, dict):
            continue
        for k in sorted(set(a) | set(b)):
            if is_secret(k) and section == "env":
                was, now = ("set" if k in a else "(unset)"), ("set" if k in b else "(unset)")
                if was != now:
                    out.append(f"{section}.{k}: {was} → {now}")
            elif a.get(k) != b.get(k):
                out.append(f"{section}.{k}: {a.get(k, '(unset)')} → {b.get(k, '(unset)')}")
    return out


def bundle(
    *,
    spec: str,
    gate: str,
    suite: str,
    topology: str,
    simulated: bool,
    engine: str | None,
    hypothesis_seed: int,
    workload_base: int,
    workload_seed: int,
    engine_args: dict[str, list[str]],
    env: dict[str, Any],
    sglang_version: str | None,
    git_sha: str,
    failure: dict[str, Any],
    workers: list[str],
    files: list[str],
    ledger_excerpt: dict[str, Any],
    sglang: dict[str, Any] | None = None,
) -> dict[str, Any]:
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
    return atomic.write_json(path, data, sort_keys=True)


def load(path: Path) -> dict[str, Any]:
    """Read and check a bundle.

    Raises:
        ReproError: missing, not JSON, another version, or a required field missing.
    """
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ReproError(
            f"{path}: file not found; pass the repro.json a gate run wrote (under report/failures/)"
        ) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ReproError(f"{path}: not JSON ({e}); pass a repro.json written by `harness gate run`") from None
    if not isinstance(data, dict):
        raise ReproError(f"{path}: not a repro bundle; pass a repro.json written by `harness gate run`")
    missing = [k for k in REQUIRED if k not in data]
    if missing:
        raise ReproError(f"{path}: missing {', '.join(missing)}; pass a repro.json written by `harness gate run`")
    if data["version"] != VERSION:
        raise ReproError(
            f"{path}: bundle version {data['version']!r}, this harness reads {VERSION}; "
            "rerun the gate with this harness"
        )
    seeds = data["seeds"]
    if not isinstance(seeds, dict) or not all(isinstance(seeds.get(k), int) for k in ("hypothesis", "workload_base")):
        raise ReproError(f"{path}: seeds.hypothesis and seeds.workload_base must be integers; fix the bundle")
    problem = _field_problem(data)
    if problem:
        raise ReproError(f"{path}: {problem}; fix the bundle or rerun the gate with this harness")
    return data


def _is_int(v: Any, low: int, high: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and low <= v <= high


def _is_str(v: Any) -> bool:
    return isinstance(v, str) and 0 < len(v) <= MAX_FIELD and "\x00" not in v


def _field_problem(data: dict[str, Any]) -> str | None:
    """The first field of a bundle with a wrong type or an out-of-range value, as a phrase (None: all fine).

    Checked before anything runs, so a tampered or damaged bundle gives one line, not a traceback after the
    target is active.

    >>> ok = {"spec": "suites/a.py::t", "topology": "cpu", "seeds": {"hypothesis": 1, "workload_base": 2}}
    >>> _field_problem(ok) is None, _field_problem({**ok, "engine": 3})
    (True, 'engine must be a string or null')
    >>> _field_problem({**ok, "seeds": {"hypothesis": -1}})
    'seeds.hypothesis must be an integer from 0 to 2**64-1'
    """
    for key in ("spec", "topology"):
        if not _is_str(data.get(key)):
            return f"{key} must be a non-empty string of at most {MAX_FIELD} characters"
    for key in ("hypothesis", "workload_base", "workload"):
        v = data["seeds"].get(key)
        if (key != "workload" or v is not None) and not _is_int(v, 0, MAX_SEED):
            return f"seeds.{key} must be an integer from 0 to 2**64-1"
    for key in ("engine", "gate", "suite", "git_sha", "sglang_version"):
        if data.get(key) is not None and not _is_str(data[key]):
            return f"{key} must be a string or null"
    if not isinstance(data.get("simulated", False), bool):
        return "simulated must be true or false"
    for key in ("failure", "environment", "engine_args", "ledger_excerpt"):
        if data.get(key) is not None and not isinstance(data[key], dict):
            return f"{key} must be an object or null"
    for key in ("workers", "files"):
        v = data.get(key)
        if v is not None and not (isinstance(v, list) and all(_is_str(x) for x in v)):
            return f"{key} must be a list of strings"
    sglang = data.get("sglang")
    if sglang is not None:
        if not isinstance(sglang, dict):
            return "sglang must be an object or null"
        if sglang.get("origin") not in ("installed", "release", "tree", "wheel"):
            return "sglang.origin must be installed, release, tree or wheel"
        for key in ("spec", "root", "version"):
            if not _is_str(sglang.get(key)):
                return f"sglang.{key} must be a non-empty string"
    return None


def target_problem(data: dict[str, Any], repo_root: Path, cache: Path) -> str | None:
    """Why a bundle's recorded sglang may not be imported here, or None.

    A bundle names code to import: a tree must lie inside the repository or the target cache (give
    ``--sglang`` to choose another), and a wheel likewise; a release or the installed sglang is named by version.

    >>> target_problem({"sglang": {"origin": "tree", "root": "/elsewhere/sglang"}}, Path("/repo"), Path("/cache"))
    'sglang tree /elsewhere/sglang lies outside the repository and the target cache'
    >>> target_problem({"sglang": {"origin": "release", "spec": "0.5.22"}}, Path("/repo"), Path("/cache")) is None
    True
    """
    sglang = data.get("sglang")
    if not isinstance(sglang, dict) or sglang.get("origin") not in ("tree", "wheel"):
        if isinstance(sglang, dict) and sglang.get("origin") == "release":
            spec = str(sglang.get("spec", ""))
            if not RELEASE_SPEC.fullmatch(spec):
                return f"sglang release {spec!r} is not a version number"
        return None
    where = Path(str(sglang.get("root" if sglang["origin"] == "tree" else "spec", "")))
    inside = any(_within(where, base) for base in (repo_root, cache))
    if not inside:
        return f"sglang {sglang['origin']} {where} lies outside the repository and the target cache"
    return None


def _within(path: Path, base: Path) -> bool:
    try:
        Path(os.path.normpath(path)).relative_to(os.path.normpath(base))
    except ValueError:
        return False
    return True
