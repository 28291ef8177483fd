"""Store-free P→D page transfer: prefill rank r writes its pages straight into decode rank r's pool
buffers through Mooncake's ``TransferEngine`` over TCP; Ray's object store stays the fallback.

Each rank opens one :class:`Endpoint`; the decode ranks' endpoints form the pair's :class:`Link`, and a message
is one call on the prefill rank. :func:`connect` chooses the path from ``HARNESS_PD_TRANSPORT`` (``auto``,
``peer``, ``store``). Why Mooncake and not Ray's tensor transport, and what it saves: docs/modules.md.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:  # a type only: collecting a simulated suite loads no numpy or torch (tests/test_api.py)
    import numpy as np

from harness.engines.sim.errors import PDError
from harness.engines.sim.ranks import Ranks

logger = logging.getLogger(__name__)

MODE_ENV = "HARNESS_PD_TRANSPORT"
MODES = ("auto", "peer", "store")
_warned: set[str] = set()  # fallback reasons already logged by this process


def mode() -> str:
    """The transport asked for: ``HARNESS_PD_TRANSPORT`` (default ``auto``).

    Raises:
        ValueError: the variable holds something else.
    """
    value = os.environ.get(MODE_ENV, "").strip().lower() or "auto"
    if value not in MODES:
        raise ValueError(f"{MODE_ENV}={os.environ[MODE_ENV]!r} is not a P→D transport; use one of {', '.join(MODES)}")
    return value


@dataclass(frozen=True)
class Link:
    """Where each prefill rank writes: decode rank r's endpoint (:meth:`Endpoint.open`) at index r."""

    targets: tuple[dict[str, Any], ...]


def connect(prefill: Ranks, decode: Ranks) -> Link | None:
    """Open every rank's endpoint; the :class:`Link`, or None for the object-store path.

    Call after the ranks' pools are (re)built: opening registers the current buffers.

    Raises:
        ValueError: ``HARNESS_PD_TRANSPORT`` is not one of :data:`MODES`.
        PDError: ``peer`` was asked for and an endpoint could not be opened.
        WorkerDied / TimeoutError: a rank is gone (not a reason to fall back).
    """
    wanted = mode()
    if wanted == "store":
        disconnect(prefill, decode)
        return None
    try:
        prefill.all("peer_open")
        targets = decode.all("peer_open")
    except (TimeoutError, PDError):
        raise
    except Exception as e:  # noqa: BLE001 - any set-up failure means: use the store
        from harness.workers import WorkerDied

        if isinstance(e, WorkerDied):
            raise
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        disconnect(prefill, decode)
        if wanted == "peer":
            raise PDError(f"{MODE_ENV}=peer but the store-free P→D transport could not be set up: {why}") from e
        reason = f"{type(e).__name__}: {why}"
        if reason not in _warned:  # one line per reason, not one per configure
            _warned.add(reason)
            logger.warning(
                "P→D transfer goes through Ray's object store: the store-free transport could not be set up (%s)",
                reason,
            )
        return None
    return Link(tuple(targets))


def disconnect(prefill: Ranks, decode: Ranks) -> None:
    """Close every rank's endpoint (idempotent): engines dropped, their ports closed."""
    prefill.all("peer_close")
    decode.all("peer_close")


def _host() -> str:
    """The address peers reach this rank at: the Ray node's IP inside Ray, else loopback."""
    try:
        import ray

        if ray.is_initialized():
            return str(ray.util.get_node_ip_address())
    except ImportError:
        pass
    return "127.0.0.1"


class Endpoint:
    """One rank's Mooncake engine with its page buffers registered (created by :meth:`open`).

    The registered views are kept referenced until the next :meth:`open` or :meth:`close`, so a write
    from a stale :class:`Link` lands in memory still owned by this endpoint, never in reused memory
    (and the decode's verification then fails), and the engine refuses addresses outside them.
    """

    def __init__(self) -> None:
        self.engine: Any = None
        self.session = ""
        self.views: list[Any] = []

    def open(self, buffers: Any) -> dict[str, Any]:
        """Register ``buffers`` (``.full`` / ``.swa`` lists of ``[pages, page_bytes]`` views).

        Returns:
            ``{"session": "host:port", "full": [address of buffer i], "swa": [...]}``.

        Raises:
            RuntimeError: a buffer is not contiguous host memory, or the engine did not start or
                refused a registration.
            ImportError: Mooncake's engine is not installed.
        """
        views = list(buffers.full) + list(buffers.swa)
        for v in views:
            if v.device.type != "cpu":
                raise RuntimeError(f"pool buffers are on {v.device}: this Mooncake build moves host memory only")
            if not v.is_contiguous():
                raise RuntimeError(f"a pool buffer view {tuple(v.shape)} with strides {v.stride()} is not contiguous")
        self._unregister()
        if self.engine is None:
            os.environ["MC_FORCE_TCP"] = "1"  # Mooncake installs its TCP transport only with this set
            from mooncake.engine import TransferEngine

            engine = TransferEngine()
            host = _host()
            ret = engine.initialize(host, "P2PHANDSHAKE", "tcp", "")
            if ret != 0:
                raise RuntimeError(f"mooncake TransferEngine.initialize({host!r}, P2PHANDSHAKE, tcp) returned {ret}")
            self.engine, self.session = engine, f"{host}:{engine.get_rpc_port()}"
        for v in views:
            ret = self.engine.register_memory(v.data_ptr(), v.numel())
            if ret != 0:
                raise RuntimeError(f"mooncake register_memory of {v.numel()} bytes returned {ret}")
            self.views.append(v)
        return {
            "session": self.session,
            "full": [int(v.data_ptr()) for v in buffers.full],
            "swa": [int(v.data_ptr()) for v in buffers.swa],
        }

    def write(
        self, target: dict[str, Any], parts: Sequence[tuple[str, Sequence[int]]], arrays: Sequence[np.ndarray]
    ) -> int:
        """Write ``arrays`` (:func:`~harness.engines.sim.kvfill.pack_pages` output, part after part) at the
        decode pages ``parts`` (``(pool, decode page ids)``) of ``target``, in one batched write.

        Returns:
            Bytes written.

        Raises:
            ValueError: the arrays do not match the parts.
            RuntimeError: no endpoint is open, or Mooncake reports the write failed.
        """
        if self.engine is None:
            raise RuntimeError("write before open: this rank has no Mooncake endpoint")
        srcs: list[int] = []
        dsts: list[int] = []
        lens: list[int] = []
        at = 0
        for pool, pages in parts:
            bases = target[pool]
            for base, a in zip(bases, arrays[at : at + len(bases)]):
                if a.shape[0] != len(pages) or not a.flags.c_contiguous:
                    raise ValueError(f"{pool}: array {a.shape} does not hold {len(pages)} contiguous pages")
                pb, src = int(a.shape[1]), int(a.ctypes.data)
                j = 0
                while j < len(pages):  # one segment per run of consecutive decode page ids
                    n = 1
                    while j + n < len(pages) and pages[j + n] == pages[j] + n:
                        n += 1
                    srcs.append(src + j * pb)
                    dsts.append(base + pages[j] * pb)
                    lens.append(n * pb)
                    j += n
            at += len(bases)
        if at != len(arrays):
            raise ValueError(f"{len(arrays)} arrays for parts that need {at}")
        if not srcs:
            return 0
        ret = self.engine.batch_transfer_sync_write(target["session"], srcs, dsts, lens)
        if ret != 0:
            raise RuntimeError(
                f"mooncake write of {len(srcs)} segment(s), {sum(lens)} bytes to {target['session']} returned {ret}"
            )
        return sum(lens)

    def _unregister(self) -> None:
        for v in self.views:
            self.engine.unregister_memory(v.data_ptr())
        self.views = []

    def close(self) -> None:
        """Unregister and drop the engine (its ports close with it). Idempotent."""
        if self.engine is not None:
            self._unregister()
            self.engine = None
            self.session = ""
