"""Joining a Ray cluster the harness did not start (``--ray-address``): checked once, before any test.

:func:`probe` decides whether this process can join, without joining: every way it can fail is one
:class:`JoinError` of one line, what failed and the fix. :func:`connect` joins and carries the harness and
the target (:mod:`harness.cluster.carry`). The kinds of error in the order they are checked, Ray's auth
rules and the probe's deadline (``HARNESS_JOIN_TIMEOUT``): docs/modules.md. Over 400 lines: one ordered probe.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from harness.cluster import carry
from harness.cluster.nodes import NodeFacts, describe, gpu_kind, skew, survey
from harness.targets.sglang import selection, travel
from harness.targets.sglang.selection import Target

log = logging.getLogger(__name__)

AUTH_MODE_ENV = "RAY_AUTH_MODE"
TOKEN_ENV = "RAY_AUTH_TOKEN"
TOKEN_PATH_ENV = "RAY_AUTH_TOKEN_PATH"
PROBE_TIMEOUT_S = 15.0  # the child's GCS round trip takes ~2 s; other runs share the CPUs
#: Env var: the probe's deadline in seconds instead of :data:`PROBE_TIMEOUT_S` (a slow link to the
#: head wants more; a check that only tells a wrong port from a GCS, less).
TIMEOUT_ENV = "HARNESS_JOIN_TIMEOUT"

_DOCS = "https://docs.ray.io/en/latest/ray-security/token-auth.html"


class JoinError(ConnectionError):
    """This process cannot join the cluster at ``address``. ``kind`` classifies it; str() is one line."""

    def __init__(self, address: str, kind: str, detail: str, fix: str):
        self.address, self.kind, self.detail, self.fix = address, kind, detail, fix
        super().__init__(f"cannot join the Ray cluster at {address}: {kind}: {detail}; {fix}")


# ------------------------------------------------------------------ auth (Ray's rules)


@dataclass(frozen=True)
class Auth:
    """This process's Ray auth settings, as Ray will read them.

    ``mode`` is ``token``, ``disabled`` or ``unset``; ``token_source`` names where Ray finds the
    token (None: nowhere); ``problem`` says why the settings cannot work at all.
    """

    mode: str
    token_source: str | None
    problem: str | None = None

    @property
    def has_token(self) -> bool:
        return self.token_source is not None


def auth_settings(environ: Mapping[str, str] | None = None, home: Path | None = None) -> Auth:
    """Read Ray's auth settings the way Ray does (token: env var, then path variable, then home file).

    Args:
        environ: the environment (default ``os.environ``).
        home: the home directory (default ``$HOME``, as Ray's loader reads it).

    Returns:
        The :class:`Auth`.
    """
    env = os.environ if environ is None else environ
    mode = (env.get(AUTH_MODE_ENV) or "unset").lower()
    home = home if home is not None else Path(env.get("HOME") or Path.home())
    problem = None
    source = None
    if mode not in ("token", "disabled", "unset"):
        problem = f"{AUTH_MODE_ENV}={env.get(AUTH_MODE_ENV)} is neither token nor disabled"
    if env.get(TOKEN_ENV, "").strip():
        source = TOKEN_ENV
    elif env.get(TOKEN_PATH_ENV):
        path = Path(env[TOKEN_PATH_ENV])
        if _readable_token(path):
            source = f"{TOKEN_PATH_ENV}={path}"
        else:  # Ray refuses this outright instead of falling back to the home file
            problem = problem or f"{TOKEN_PATH_ENV}={path} names no readable, non-empty file"
    elif _readable_token(home / ".ray" / "auth_token"):
        source = str(home / ".ray" / "auth_token")
    if mode == "token" and source is None and problem is None:
        problem = (
            f"{AUTH_MODE_ENV}=token but no token: neither {TOKEN_ENV}, {TOKEN_PATH_ENV} nor {home}/.ray/auth_token"
        )
    return Auth(mode, source, problem)


def _readable_token(path: Path) -> bool:
    try:
        return bool(path.read_text().strip())
    except OSError:
        return False


# ------------------------------------------------------------------ probe


@dataclass(frozen=True)
class ClusterMeta:
    """What the GCS says about the cluster before anyone joins it."""

    address: str
    ray_version: str
    python_version: str


def split_address(address: str) -> tuple[str, int]:
    """``host:port`` → (host, port).

    Raises:
        JoinError: ``address`` is not ``host:port`` (kind ``address``).
    """
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise JoinError(
            address,
            "address",
            "not host:port",
            "pass the head's GCS address, e.g. 10.0.0.1:6379 (`ray status` on the head prints it)",
        )
    return host, int(port)


def probe_timeout(address: str, environ: Mapping[str, str] | None = None) -> float:
    """The probe's deadline: ``HARNESS_JOIN_TIMEOUT`` seconds when set, else :data:`PROBE_TIMEOUT_S`.

    Raises:
        JoinError: the variable is set but is not a number of seconds > 0 (kind ``setting``).
    """
    env = os.environ if environ is None else environ
    raw = env.get(TIMEOUT_ENV, "").strip()
    if not raw:
        return PROBE_TIMEOUT_S
    try:
        seconds = float(raw)
    except ValueError:
        seconds = float("nan")
    if not 0 < seconds < float("inf"):
        raise JoinError(
            address,
            "setting",
            f"{TIMEOUT_ENV}={raw} is not a number of seconds > 0",
            f"set {TIMEOUT_ENV} to the seconds the head's GCS may take to answer (default "
            f"{PROBE_TIMEOUT_S:g}), or unset it",
        )
    return seconds


def probe(address: str, *, timeout: float | None = None, environ: Mapping[str, str] | None = None) -> ClusterMeta:
    """Check that this process can join the cluster at ``address``; join nothing.

    Args:
        address: the head's GCS address, ``host:port``.
        timeout: seconds for the GCS to answer (the TCP check takes at most 5 of them); default
            :func:`probe_timeout`.
        environ: the environment the join will run with (default ``os.environ``).

    Returns:
        The cluster's :class:`ClusterMeta`.

    Raises:
        JoinError: the first thing that fails, classified (see the module docstring).
    """
    env = dict(os.environ if environ is None else environ)
    host, port = split_address(address)
    if timeout is None:
        timeout = probe_timeout(address, env)
    auth = auth_settings(env)
    if auth.problem:
        raise JoinError(
            address,
            "auth",
            auth.problem,
            f"set {TOKEN_ENV}, or {TOKEN_PATH_ENV} to the cluster's token file, or unset {AUTH_MODE_ENV} "
            "for a cluster without token auth",
        )
    try:
        socket.create_connection((host, port), timeout=min(5.0, timeout)).close()
    except OSError as e:
        raise JoinError(
            address,
            "unreachable",
            f"nothing accepts connections ({e.strerror or e})",
            "check the address and that the head runs (`ray status` on the head)",
        ) from None
    answer = _ask_gcs(address, timeout, env)
    if "error" in answer:
        raise _classify(address, answer, auth, timeout)
    meta = ClusterMeta(address, answer["ray_version"], answer["python_version"])
    check_versions(meta, answer["match_level"], environ=env)
    return meta


_GCS_CHILD = r"""
import json, os, sys
from ray._raylet import GcsClient
out = {"match_level": os.environ.get("RAY_DEFAULT_PYTHON_VERSION_MATCH_LEVEL", "patch")}
try:
    gcs = GcsClient(address=sys.argv[1])
    raw = gcs.internal_kv_get(b"CLUSTER_METADATA", namespace=b"cluster", timeout=5)
    out.update(json.loads(raw) if raw else {"error": "no-metadata", "message": "the GCS holds no cluster metadata"})
except Exception as e:
    out.update(error=type(e).__name__, message=" ".join(str(e).split())[:300])
print(json.dumps(out), flush=True)
"""


def _ask_gcs(address: str, timeout: float, env: dict[str, str]) -> dict[str, Any]:
    """The cluster's metadata (``ray_version``, ``python_version``), or ``{"error": ..., "message": ...}``."""
    try:
        done = subprocess.run(
            [sys.executable, "-c", _GCS_CHILD, address],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired:
        return {"error": "timeout", "message": f"no Ray GCS answered within {timeout:g} s"}
    lines = done.stdout.strip().splitlines()
    try:
        return json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        last = next((ln for ln in reversed(done.stderr.splitlines()) if ln.strip()), "")
        return {"error": "crashed", "message": f"the probe exited {done.returncode}: {last.strip()[:200]}"}


def _classify(address: str, answer: dict[str, Any], auth: Auth, timeout: float) -> JoinError:
    kind, message = answer["error"], answer.get("message", "")
    if kind == "AuthenticationError" or "Unauthenticated" in message or "InvalidAuthToken" in message:
        if auth.mode == "token":
            return JoinError(
                address,
                "auth",
                f"refused the token from {auth.token_source} ({message})",
                f"use the cluster's own token (`ray get-auth-token` on the head) in {TOKEN_ENV} or "
                f"{TOKEN_PATH_ENV}; see {_DOCS}",
            )
        if auth.has_token:
            return JoinError(
                address,
                "auth",
                f"the cluster requires token authentication and {AUTH_MODE_ENV} is "
                f"{auth.mode} (a token is in {auth.token_source}, but Ray sends it to an explicit "
                "address only when told to)",
                f"set {AUTH_MODE_ENV}=token (with the cluster's token) and rerun",
            )
        return JoinError(
            address,
            "auth",
            "the cluster requires token authentication and this process has no token",
            f"set {AUTH_MODE_ENV}=token and {TOKEN_ENV} (or {TOKEN_PATH_ENV}) to the cluster's token "
            f"(`ray get-auth-token` on the head); see {_DOCS}",
        )
    if kind == "timeout":
        return JoinError(
            address,
            "not-ray",
            f"something accepts connections but {message}",
            "pass the GCS port of the head (`ray start --head --port`; 6379 by default)",
        )
    if kind in ("RpcError", "GetTimeoutError"):
        return JoinError(
            address,
            "not-ray",
            f"something accepts connections but no Ray GCS answered ({message})",
            "pass the GCS port of the head (`ray start --head --port`; 6379 by default)",
        )
    return JoinError(
        address,
        "not-ray",
        f"the GCS could not be read ({kind}: {message})",
        "check the address is the head's GCS and that the head is healthy (`ray status` on the head)",
    )


def our_versions() -> tuple[str, str]:
    """(Ray, Python) of this process, as Ray compares them."""
    import platform

    import ray

    return ray.__version__, platform.python_version()


def check_versions(meta: ClusterMeta, match_level: str = "patch", *, environ: Mapping[str, str] | None = None) -> None:
    """Ray's own join rule: the same Ray, and Python to ``match_level`` (``patch`` or ``minor``).

    Raises:
        JoinError: kind ``version``, naming both versions.
    """
    ray_v, py_v = our_versions()
    py_ok = (
        (py_v.split(".")[:2] == meta.python_version.split(".")[:2])
        if match_level == "minor"
        else py_v == meta.python_version
    )
    if ray_v == meta.ray_version and py_ok:
        return
    diffs = []
    if ray_v != meta.ray_version:
        diffs.append(f"Ray {ray_v} here, {meta.ray_version} on the cluster")
    if not py_ok:
        diffs.append(f"Python {py_v} here ({sys.executable}), {meta.python_version} on the cluster")
    raise JoinError(
        meta.address,
        "version",
        "; ".join(diffs),
        "run the harness with the cluster's Ray and Python (the same image or `./dev install` from the "
        "same commit with the same Python)",
    )


# ------------------------------------------------------------------ the connection


def connect(address: str, target: Target | None = None) -> None:
    """Connect this process to the joined cluster at ``address``, carrying what the run needs there
    (:func:`harness.cluster.carry.runtime_env`: the harness and a tree or wheel target; uploading a
    full sglang tree takes seconds, once per content).

    Args:
        address: the head's GCS address (probed first: :func:`probe`).
        target: the run's sglang target (default: the one this process runs).

    Raises:
        JoinError: kind ``carry``, a package could not be uploaded (too large, unreadable); this
            process is not connected afterwards.
    """
    import ray
    from ray.exceptions import RuntimeEnvSetupError

    target = selection.current() if target is None else target
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    try:
        ray.init(address=address, logging_level="ERROR", log_to_driver=False, runtime_env=carry.runtime_env(target))
    except (RuntimeEnvSetupError, OSError) as e:  # Ray's wrapper of a failed upload; a file it could not read
        if ray.is_initialized():
            ray.shutdown()
        what = f"{target.label()} and the harness" if travel.travels(target) else "the harness"
        raise JoinError(
            address,
            "carry",
            f"cannot ship {what} to its nodes ({' '.join(str(e).split())[:300]})",
            "leave large files (build outputs, checkpoints) out of the tree, or install the same "
            "sglang on every node and pass it by version",
        ) from None


# ------------------------------------------------------------------ the preflight


@dataclass(frozen=True)
class Preflight:
    """What :func:`preflight` learned: the cluster's metadata and nodes."""

    meta: ClusterMeta
    nodes: tuple[NodeFacts, ...]

    @property
    def gpu_kind(self) -> str:
        return gpu_kind(list(self.nodes))

    def summary(self) -> str:
        return (
            f"joined Ray cluster at {self.meta.address}: Ray {self.meta.ray_version}, Python "
            f"{self.meta.python_version}, {len(self.nodes)} node(s): {describe(list(self.nodes))}"
        )


def preflight(address: str, *, timeout: float | None = None) -> Preflight:
    """Everything a run on a joined cluster checks before it places a worker: probe, join, survey, skew.

    Joins from this process (and leaves again), so the runs it then starts find the same answers.

    Args:
        address: the head's GCS address.
        timeout: the probe's deadline (default :func:`probe_timeout`).

    Returns:
        The :class:`Preflight`.

    Raises:
        JoinError: cannot join (see :func:`probe`), or a node differs in versions (kind ``version skew``).
    """
    import ray

    meta = probe(address, timeout=timeout)
    if ray.is_initialized():
        raise RuntimeError("this process is already connected to Ray; the preflight joins on its own")
    connect(address)
    try:
        nodes = survey()
    finally:
        ray.shutdown()
    error = skew_error(address, nodes)
    if error:
        raise error
    return Preflight(meta, tuple(nodes))


def skew_error(address: str, nodes: list[NodeFacts]) -> JoinError | None:
    """The one-line error for nodes whose versions differ from this process's (None: no skew)."""
    problems = skew(nodes)
    if not problems:
        return None
    return JoinError(
        address,
        "version skew",
        "; ".join(problems),
        "install the same versions on every node and on this machine (one image, or `./dev install` "
        "from the same commit); `harness doctor TOPOLOGY --ray-address ADDR` checks every node",
    )
