"""From a topology role to the exact command line of a real sglang server or router process.

Pure functions: nothing here starts a process or imports sglang, so the argv of every topology role can be
tested exactly and fast. :func:`server_command` (prefill, decode), :func:`plain_server_command` (the parity
baseline) and :func:`router_command`; GPUs are never chosen here, and role ``engine_args`` win over these
defaults. The flags, the CPU recipe and sglang's checks: docs/modules.md. Over 400 lines: every role's
flags in one place, so the argv of a role reads top to bottom.
"""

from __future__ import annotations

import functools
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

from harness.rundir import RunDir
from harness.targets.sglang import releases, selection
from harness.targets.sglang.compat import checks
from harness.engines import alloc_order
from harness.engines.server import alloc_patch, kv_heads, rdma
from harness.topology import RoleSpec, Topology

#: Directory put on every server's PYTHONPATH: its ``sitecustomize`` installs the compat patches,
#: the accounting probe and the fault catalog when their env vars ask for them.
SITE_DIR = Path(__file__).resolve().parent / "pythonpath" / "site"
#: Directory put on PYTHONPATH on CPU topologies only: the import-only ``sgl_kernel`` shim.
CPU_SHIM_DIR = Path(__file__).resolve().parent / "pythonpath" / "cpu"

#: Server flags of the CPU recipe (torch-native attention, no CUDA graphs, a small fixed KV pool).
CPU_SERVER_ARGS: tuple[str, ...] = (
    "--device",
    "cpu",
    "--attention-backend",
    "torch_native",
    "--disable-cuda-graph",
    "--max-total-tokens",
    "8192",
    "--page-size",
    "64",
    "--random-seed",
    "0",
    # An idle scheduler otherwise loops without pause (its idle self-check included): about half a
    # core per idle server, a whole core for an idle PD pair on a 2-core runner. sglang's own
    # option waits on its request sockets instead; it sleeps only when fully idle (a pending KV
    # transfer is not idle), so no request waits on it.
    "--sleep-on-idle",
)
#: Prefill on CPU: overlap scheduling records a torch.cuda.Event on a cached-prefix send.
CPU_PREFILL_ARGS: tuple[str, ...] = ("--disable-overlap-schedule",)
#: Decode on CPU: the default retraction backup is a device tensor. Only where the target has the
#: option (first in 0.5.18: 0.5.16 / 0.5.17 have no retraction backup and refuse the flag).
CPU_DECODE_ARGS: tuple[str, ...] = ("--disaggregation-decode-retraction-backup", "cpu_tensor")
#: Env of every server on CPU: sglang's CPU platform, no hub, mooncake over TCP on loopback.
CPU_ENV: Mapping[str, str] = {
    "SGLANG_USE_CPU_ENGINE": "1",
    "HF_HUB_OFFLINE": "1",
    "SGLANG_HOST_IP": "127.0.0.1",
    "MOONCAKE_PROTOCOL": "tcp",
    "MC_FORCE_TCP": "1",
    # A stop (SIGTERM to the server's process group) ends its scheduler first, which sglang's watchdog
    # takes for a crash: by default it then sleeps 5 s "to let GPU activity settle" before a py-spy
    # dump and a CUDA coredump, neither of which a CPU server has, and the stop waits that out.
    "SGLANG_PYSPY_DUMP_BEFORE_CRASH": "0",
    "SGLANG_CUDA_COREDUMP_BEFORE_CRASH": "0",
    # A dead peer on loopback: decode notices it after one missed heartbeat of a second (sglang's
    # default, 5 s x 2 misses, is sized for real networks), and a failed transfer's deferred release
    # waits 5 s, not 30, for acknowledgements loopback delivers in milliseconds.
    "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": "1",
    "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT": "5",
    # The tiny models' classes (pythonpath/cpu/harness_tiny_models, sglang's own classes): the model
    # registry resolves them without importing its ~150 other modules, ~3 s of every server's start.
    "SGLANG_EXTERNAL_MODEL_PACKAGE": "harness_tiny_models",
}
#: Compat patches every server on a CPU topology gets (names from ``compat.PATCHES``).
CPU_COMPAT_PATCHES: tuple[str, ...] = (
    "mooncake-host-tensor-indices",
    "torch-native-swa-read",
    "cpu-fork-children",
    "cpu-tp-without-pynccl",
)

#: Decode-side HiSparse (DeepSeek-V4 class; sglang 0.5.23 ``--enable-hisparse``). It is a decode
#: feature only (decode receives the KV into the HiSparse host pool; prefill sends as usual), and
#: sglang refuses it unless the radix cache is off: a PD decode server turns it off by default, said
#: explicitly here so the check never depends on the order sglang resolves its arguments in.
HISPARSE_DECODE_ARGS: tuple[str, ...] = ("--enable-hisparse", "--disable-radix-cache")

#: Env vars read by the sitecustomize in :data:`SITE_DIR`.
COMPAT_ENV = "HARNESS_COMPAT_PATCHES"
PROBE_LEDGER_ENV = "HARNESS_PROBE_LEDGER"
PROBE_WORKER_ENV = "HARNESS_PROBE_WORKER"
PROBE_COMPONENT_ENV = "HARNESS_PROBE_COMPONENT"
KV_HEADS_ENV = kv_heads.HEADS_ENV

#: Per role kind, the env var naming the TARGET a server of that kind runs instead of the run's
#: (:func:`role_target`): a pair of two sglang releases, trees or wheels (``harness matrix --pair``).
ROLE_TARGET_ENV: Mapping[str, str] = {"prefill": "HARNESS_SGLANG_PREFILL", "decode": "HARNESS_SGLANG_DECODE"}

SERVER_MODULE = "sglang.launch_server"
#: The router's entry point: upstream's ``sglang_router.launch_router`` flags and Rust router, without
#: its module-level import of sglang (5 CPU-s per start; :mod:`.router` says why).
ROUTER_MODULE = "harness.engines.server.router"
SERVER_KINDS = ("prefill", "decode")


class LaunchError(ValueError):
    """A command cannot be built from what was given (wrong role kind, missing port)."""


@dataclass(frozen=True)
class ServerPorts:
    """Ports of one server, each obtained from the OS by the harness (never computed from a base).

    A port may also be a ``"{name}"`` placeholder that :mod:`harness.workers` fills with the port
    the OS gave the worker.
    """

    http: int | str
    nccl: int | str
    bootstrap: int | str | None = None  # prefill only: where decode fetches the KV


@dataclass(frozen=True)
class Command:
    """What to run for one role: argv, env additions and the PYTHONPATH entries to prepend."""

    role: str
    argv: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)
    pythonpath: tuple[str, ...] = ()

    def environ(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """The full environment for the process: ``base`` (default ``os.environ``) plus ours.

        ``PYTHONPATH`` entries are prepended to the inherited ones, never replace them.
        """
        env = dict(os.environ if base is None else base)
        env.update(self.env)
        if self.pythonpath:
            inherited = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
            env["PYTHONPATH"] = os.pathsep.join([*self.pythonpath, *inherited])
        return env


def _has_flag(args: Sequence[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


def _merge(defaults: Sequence[str], overrides: Sequence[str]) -> list[str]:
    """Defaults (a flat flag/value list) minus the flags ``overrides`` sets, then ``overrides``."""
    out: list[str] = []
    i = 0
    while i < len(defaults):
        flag = defaults[i]
        takes_value = i + 1 < len(defaults) and not defaults[i + 1].startswith("--")
        if not _has_flag(overrides, flag):
            out.extend(defaults[i : i + 1 + takes_value])
        i += 1 + takes_value
    return out + list(overrides)


def _parallel_args(role: RoleSpec) -> list[str]:
    args = ["--tp", str(role.tp)]
    if role.dp > 1:
        args += ["--dp-size", str(role.dp)]
    if role.dp_attention:
        args.append("--enable-dp-attention")
    return args


def _cpu_env(patches: Sequence[str] | None) -> dict[str, str]:
    env = dict(CPU_ENV)
    chosen = CPU_COMPAT_PATCHES if patches is None else tuple(patches)
    if chosen:
        env[COMPAT_ENV] = ",".join(chosen)
    return env


#: sglang's per-rank CPU cores for a CPU server of TP > 1 (``0|1``: rank 0 on core 0, rank 1 on core 1); sglang
#: refuses to start one without it when the machine has fewer NUMA nodes than ranks.
CPU_TP_BIND_ENV = "SGLANG_CPU_OMP_THREADS_BIND"


def _cpu_tp_env(tp: int) -> dict[str, str]:
    """A CPU server of ``tp`` > 1 ranks binds rank ``i`` to core ``i`` modulo this machine's cores (its ranks
    take turns on a core when there are fewer cores than ranks)."""
    if tp <= 1:
        return {}
    cores = os.cpu_count() or 1
    return {CPU_TP_BIND_ENV: "|".join(str(i % cores) for i in range(tp))}


def _unequal_tp(topology: Topology) -> bool:
    """Whether the topology's prefill and decode attention TP differ (heterogeneous PD)."""
    sizes = {r.attn_tp for r in topology.roles if r.kind in SERVER_KINDS}
    return len(sizes) > 1


def _probe_env(run_dir: str | Path | None, worker: str, component: str, topology: Topology) -> dict[str, str]:
    if run_dir is None:
        return {}
    run = RunDir(Path(run_dir))
    env = {PROBE_LEDGER_ENV: str(run.ledger_file(worker)), PROBE_WORKER_ENV: worker, PROBE_COMPONENT_ENV: component}
    if component in SERVER_KINDS and _unequal_tp(topology):
        env[KV_HEADS_ENV] = str(run.kv_heads)  # every rank's per-head digests (engines/server/kv_heads.py)
    return env


@functools.lru_cache(maxsize=8)
def _resolved(spec: str) -> selection.Target:
    return selection.resolve(spec)


def role_target(kind: str) -> tuple[selection.Target, bool]:
    """The sglang a server of role ``kind`` runs, and whether it is its own: ``$HARNESS_SGLANG_PREFILL`` /
    ``$HARNESS_SGLANG_DECODE`` where set (a mixed pair, ``harness matrix --pair``), else the run's
    (``$HARNESS_SGLANG``). Resolved but never activated here: building a command must not select a
    target in the process that builds it.

    Raises:
        TargetError: the TARGET cannot be used.
    """
    own = (os.environ.get(ROLE_TARGET_ENV.get(kind, "")) or "").strip()
    return _resolved(own or (os.environ.get(selection.ENV_VAR) or selection.INSTALLED).strip()), bool(own)


def _target_env(target: selection.Target) -> tuple[dict[str, str], list[str]]:
    """The env and the PYTHONPATH entries (first) of a server that runs ``target`` rather than the run's:
    its TARGET (its ``sitecustomize`` selects it), the environment the release needs
    (:func:`releases.process_env`) and its directories, the installed one's too (the run's own
    target, inherited on the path behind these, must not shadow it)."""
    env = {selection.ENV_VAR: target.spec, **releases.process_env(Path(target.root))}
    return env, [target.root, *target.deps]


def _engine_command(
    topology: Topology,
    role: RoleSpec,
    mode_args: list[str],
    *,
    model: str | Path,
    ports: ServerPorts,
    host: str,
    python: str,
    compat_patches: Sequence[str] | None,
    probe_run_dir: str | Path | None,
    worker: str,
    extra_args: Sequence[str],
    mode_env: Mapping[str, str] | None = None,
    extra_env: Mapping[str, str] | None = None,
) -> Command:
    base = [
        "--model-path",
        str(model),
        "--host",
        host,
        "--port",
        str(ports.http),
        "--nccl-port",
        str(ports.nccl),
        *_parallel_args(role),
        *mode_args,
    ]
    env: dict[str, str] = dict(mode_env or {})
    pythonpath = [str(SITE_DIR)]
    target, own_target = role_target(role.kind)
    if not topology.needs_gpus:
        base += CPU_SERVER_ARGS
        if role.kind == "prefill":
            base += CPU_PREFILL_ARGS
        elif role.kind == "decode" and releases.server_option(
            Path(target.root), "disaggregation_decode_retraction_backup"
        ):
            base += CPU_DECODE_ARGS
        env.update(_cpu_env(compat_patches))
        env.update(_cpu_tp_env(role.tp))
        pythonpath.append(str(CPU_SHIM_DIR))
    elif compat_patches:
        env[COMPAT_ENV] = ",".join(compat_patches)
    if own_target:
        target_env, target_paths = _target_env(target)
        env.update(target_env)
        pythonpath += target_paths
    env.update(_probe_env(probe_run_dir, worker, role.kind, topology))
    # sglang's own checks, the second oracle: every variable of every check (a release that lacks
    # one never reads it; what the target has is said once per session, compat.checks.summary).
    env.update(checks.environment(None))
    env.update(extra_env or {})
    # The allocation-order knobs (HARNESS_ALLOC_ORDER / HARNESS_POOL_PAGES, a role's extra_env first):
    # the order travels in the env to sitecustomize, the pool size becomes --max-total-tokens.
    order, pages = alloc_order.knobs({**os.environ, **env})
    if order != alloc_order.SGLANG:
        env[alloc_order.ORDER_ENV] = order
    explicit = [*role.engine_args, *extra_args]
    pool = alloc_patch.pool_args(pages, _merge(base, explicit), explicit)
    argv = [python, "-m", SERVER_MODULE, *_merge(base, [*explicit, *pool])]
    return Command(role=worker, argv=tuple(argv), env=env, pythonpath=tuple(pythonpath))


def server_command(
    topology: Topology,
    role_name: str,
    *,
    model: str | Path,
    ports: ServerPorts,
    host: str = "127.0.0.1",
    python: str = sys.executable,
    compat_patches: Sequence[str] | None = None,
    probe_run_dir: str | Path | None = None,
    worker: str | None = None,
    extra_args: Sequence[str] = (),
    extra_env: Mapping[str, str] | None = None,
) -> Command:
    """Build the ``sglang.launch_server`` command of a prefill or decode role.

    Args:
        topology: the topology the role belongs to (its transfer backend; CPU or GPU recipe).
        role_name: a role of ``topology`` whose kind is ``prefill`` or ``decode``.
        model: model directory (or name the server can resolve offline).
        ports: the leased ports (or their placeholders); ``bootstrap`` is required for prefill.
        host: address the server binds and advertises.
        python: interpreter to run (default: this one, i.e. the harness's venv).
        compat_patches: compat patch names to enable; ``None`` means the topology's default
            (:data:`CPU_COMPAT_PATCHES` on CPU, none on GPU); ``()`` means none.
        probe_run_dir: when given, the accounting probe writes ``<run_dir>/ledger/<worker>.jsonl``.
        worker: worker name used in the ledger and the command (default: the role name).
        extra_args: more server flags, after the role's ``engine_args`` (they win over defaults).
        extra_env: more environment for the server, set last (it wins over the recipe's): sglang's
            knobs that only an env var sets, e.g. ``SGLANG_DISAGGREGATION_WAITING_TIMEOUT``.

    Returns:
        The :class:`Command`.

    Raises:
        LaunchError: the role is not a server role, or prefill has no bootstrap port.
        KeyError: no such role in the topology.
    """
    role = topology.role(role_name)
    if role.kind not in SERVER_KINDS:
        raise LaunchError(f"role {role_name!r} is a {role.kind}, not a server; use router_command for routers")
    mode = ["--disaggregation-mode", role.kind, "--disaggregation-transfer-backend", topology.transfer_backend]
    if role.kind == "prefill":
        if ports.bootstrap is None:
            raise LaunchError(f"prefill role {role_name!r} needs a bootstrap port; pass ServerPorts(bootstrap=...)")
        mode += ["--disaggregation-bootstrap-port", str(ports.bootstrap)]
    # Its RDMA devices follow the GPUs Ray gives it, known when it starts (:mod:`.rdma`).
    mode_env = (
        {rdma.NODE_GPUS_ENV: str(topology.gpus_per_node)}
        if topology.needs_gpus and topology.transfer_backend == "mooncake"
        else {}
    )
    return _engine_command(
        topology,
        role,
        mode,
        model=model,
        ports=ports,
        host=host,
        python=python,
        compat_patches=compat_patches,
        probe_run_dir=probe_run_dir,
        worker=worker or role_name,
        extra_args=extra_args,
        mode_env=mode_env,
        extra_env=extra_env,
    )


def plain_server_command(
    topology: Topology,
    *,
    model: str | Path,
    ports: ServerPorts,
    host: str = "127.0.0.1",
    python: str = sys.executable,
    compat_patches: Sequence[str] | None = None,
    worker: str = "plain",
    extra_args: Sequence[str] = (),
    probe_run_dir: str | Path | None = None,
) -> Command:
    """Build a non-disaggregated server on the topology's decode role shape: the parity baseline.

    Args and Returns as :func:`server_command` (no bootstrap port; the probe, when asked for,
    records only cache flushes: component ``plain``).

    Raises:
        LaunchError: never for a valid topology (it always has a decode role).
    """
    decode = topology.roles_of("decode")[0]
    plain = RoleSpec(
        name=worker,
        kind="plain",
        tp=decode.tp,
        dp=decode.dp,
        dp_attention=decode.dp_attention,
        gpus_per_rank=decode.gpus_per_rank,
        engine_args=decode.engine_args,
    )
    return _engine_command(
        topology,
        plain,
        [],
        model=model,
        ports=ports,
        host=host,
        python=python,
        compat_patches=compat_patches,
        probe_run_dir=probe_run_dir,
        worker=worker,
        extra_args=extra_args,
    )


def router_command(
    topology: Topology,
    *,
    prefill: Sequence[tuple[str, int | str | None]],
    decode: Sequence[str],
    port: int | str,
    prometheus_port: int | str,
    host: str = "127.0.0.1",
    python: str = sys.executable,
    mini_lb: bool = False,
    policy: str = "round_robin",
    worker: str = "router",
) -> Command:
    """Build the router role's command (sglang-router's flags, run by :data:`ROUTER_MODULE`).

    Args:
        topology: the topology (must have a router role).
        prefill: ``(url, bootstrap_port)`` of each prefill server.
        decode: URL of each decode server. Neither (both empty): the router starts with no server,
            each registered later through its ``/workers`` API (not with ``mini_lb``).
        port: the router's leased HTTP port.
        prometheus_port: its leased metrics port (the router's default, 29000, would collide).
        host: bind address.
        python: interpreter to run.
        mini_lb: add ``--mini-lb`` (the Python load balancer instead of the Rust router).
        policy: load-balancing policy (MiniLB supports only ``random``, which it is then given).
        worker: worker name.

    Returns:
        The :class:`Command`.

    Raises:
        LaunchError: the topology has no router role, or no prefill / decode URL was given.
    """
    role = topology.roles_of("router")[0] if topology.roles_of("router") else None
    if role is None:
        raise LaunchError(f"topology {topology.name!r} has no router role; add [roles.router]")
    if (not prefill or not decode) and (prefill or decode or mini_lb):
        raise LaunchError(
            "a PD router needs at least one prefill and one decode URL (or none of either, "
            "to register them later through its /workers API; MiniLB has none)"
        )
    argv = [
        python,
        "-m",
        ROUTER_MODULE,
        "--host",
        host,
        "--port",
        str(port),
        "--prometheus-host",
        host,
        "--prometheus-port",
        str(prometheus_port),
        "--pd-disaggregation",
        "--policy",
        "random" if mini_lb else policy,
    ]
    if mini_lb:
        # MiniLB (the Python balancer) is PD-only and overrides any policy but random.
        argv.append("--mini-lb")
    for url, bootstrap in prefill:
        argv += ["--prefill", url, str(bootstrap) if bootstrap is not None else "none"]
    for url in decode:
        argv += ["--decode", url]
    argv += list(role.engine_args)
    return Command(role=worker, argv=tuple(argv), env={})
