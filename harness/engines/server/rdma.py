"""Which RDMA devices a GPU server's KV transfer opens: its ``--disaggregation-ib-device``.

The harness picks them as sglang's own PD fixture does in its CI, so a server talks over the NICs an
upstream test would give it (``HARNESS_IB_DEVICES`` overrides). The GPUs are known only once Ray started the
worker, so the server's ``sitecustomize`` completes the command (:func:`complete_argv`). The rule:
docs/modules.md.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Mapping, Sequence

log = logging.getLogger(__name__)

IB_SYSFS = Path("/sys/class/infiniband")
#: Names the node's RDMA devices instead of sysfs (comma list; empty: none).
DEVICES_ENV = "HARNESS_IB_DEVICES"
#: Set on a GPU server by :mod:`.launcher`: its node's GPU count; the server's ``sitecustomize`` then
#: adds ``--disaggregation-ib-device`` for its ``CUDA_VISIBLE_DEVICES``.
NODE_GPUS_ENV = "HARNESS_IB_NODE_GPUS"
FLAG = "--disaggregation-ib-device"
SERVER_MODULE = "sglang.launch_server"
#: Slower ports are ordinary Ethernet NICs, not the RDMA fabric (the fixture's threshold).
MIN_RATE_GBPS = 100


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8").strip()
    except OSError:
        return ""


def node_devices(sysfs: Path = IB_SYSFS, environ: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """The node's RDMA devices for KV transfer, in name order.

    Args:
        sysfs: the ``infiniband`` class directory to read.
        environ: where :data:`DEVICES_ENV` is looked up (default ``os.environ``).

    Returns:
        The device names (empty: none usable, or none named).
    """
    env = os.environ if environ is None else environ
    if DEVICES_ENV in env:
        return tuple(d.strip() for d in env[DEVICES_ENV].split(",") if d.strip())
    try:
        names = sorted(p.name for p in sysfs.iterdir())
    except OSError:
        return ()
    found = []
    for name in names:
        port = sysfs / name / "ports" / "1"
        if "eth" in name.lower() or not port.is_dir() or "ACTIVE" not in _read(port / "state").upper():
            continue
        rate = _read(port / "rate").split()
        if rate and rate[0].isdigit() and int(rate[0]) < MIN_RATE_GBPS:
            continue
        found.append(name)
    return tuple(found)


def for_gpus(gpus: Sequence[int], devices: Sequence[str], node_gpus: int) -> str | None:
    """The ``--disaggregation-ib-device`` value of a server driving ``gpus`` (node GPU indices).

    Args:
        gpus: the server's GPUs, as indices on its node.
        devices: the node's RDMA devices (:func:`node_devices`).
        node_gpus: how many GPUs the node has.

    Returns:
        A comma list of devices (each once, in GPU order), or None when there is no device or GPU.
    """
    if not devices or not gpus:
        return None
    per_device = max(1, max(node_gpus, max(gpus) + 1) // len(devices))
    picked = [devices[min(g // per_device, len(devices) - 1)] for g in sorted(set(gpus))]
    return ",".join(dict.fromkeys(picked))


def visible_gpus(environ: Mapping[str, str]) -> tuple[int, ...] | None:
    """Node GPU indices in ``CUDA_VISIBLE_DEVICES`` (None: unset, empty, or not indices, e.g. UUIDs)."""
    items = [x.strip() for x in environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if x.strip()]
    if not items or not all(x.isdigit() for x in items):
        return None
    return tuple(int(x) for x in items)


def complete_argv(argv: Sequence[str], environ: Mapping[str, str], sysfs: Path = IB_SYSFS) -> list[str]:
    """``argv`` of a server with ``--disaggregation-ib-device`` for its GPUs added.

    Nothing is added when the server already has the flag, when :data:`NODE_GPUS_ENV` is unset, or
    when no device or GPU index is found (mooncake's own choice stands).

    Args:
        argv: the server's arguments (after ``-m sglang.launch_server``).
        environ: its environment (``CUDA_VISIBLE_DEVICES``, :data:`NODE_GPUS_ENV`, :data:`DEVICES_ENV`).
        sysfs: the ``infiniband`` class directory to read.

    Returns:
        The arguments, the flag and its value last when added.
    """
    args = list(argv)
    node_gpus = environ.get(NODE_GPUS_ENV, "")
    if not node_gpus.isdigit() or any(a == FLAG or a.startswith(FLAG + "=") for a in args):
        return args
    gpus = visible_gpus(environ)
    value = for_gpus(gpus or (), node_devices(sysfs, environ), int(node_gpus))
    if value is None:
        log.info(
            "no RDMA device for GPUs %s (CUDA_VISIBLE_DEVICES=%r): mooncake chooses",
            gpus,
            environ.get("CUDA_VISIBLE_DEVICES", ""),
        )
        return args
    log.info("%s %s for GPUs %s", FLAG, value, list(gpus or ()))
    return [*args, FLAG, value]


def install_from_env() -> None:
    """In a server's ``sitecustomize``: complete this process's own command line (:func:`complete_argv`).

    Only a ``python -m sglang.launch_server`` process is changed (its children, started with
    other command lines, inherit the environment and are left alone).
    """
    import sys

    orig = list(getattr(sys, "orig_argv", ()))
    if SERVER_MODULE not in orig or orig[orig.index(SERVER_MODULE) - 1] != "-m":
        return
    sys.argv[1:] = complete_argv(sys.argv[1:], os.environ)
