"""What the prefill and decode rank payloads share: identity, pool sizes, and their ledger."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from harness import faults
from harness.ledger import CONFIG_RID, LedgerConfig, LedgerWriter, config_event
from harness.engines.sim.peer import Endpoint
from harness.engines.sim.workload import KVSpec
from harness.rundir import RunDir


class RankPayload:
    """Base of a prefill or decode rank payload: one TP rank, writing its accounting events to
    ``<run_dir>/ledger/<name>.jsonl``.

    The driver calls the ledger methods through the rank's worker (``worker.call("ledger_events", since)``).
    A rank runs engine code, so it applies the faults named for the run (``HARNESS_FAULTS``, which
    :mod:`harness.engines.sim.deploy` gives every rank) before it builds anything.

    Args:
        name: worker name (ledger file ``<run_dir>/ledger/<name>.jsonl``).
        shard: TP rank (its head shard).
        tp: TP size of the role (the rank stores ``spec.kv_heads // tp`` KV heads).
        run_dir: the run directory.
        component: ``prefill`` or ``decode`` (the ledger's component).
        spec: the pool configuration, which :meth:`configure` builds the pools for; None: not yet.

    Raises:
        ValueError: ``shard`` is not a rank of ``tp``.
        FaultError: ``HARNESS_FAULTS`` names an unknown fault, or a patch the imported sglang lacks.
    """

    buffers: Any  # the pool buffers a transfer moves (``.full`` / ``.swa`` page views), set by configure()
    peer: Endpoint | None = None

    def __init__(self, name: str, shard: int, tp: int, run_dir: str, component: str, spec: KVSpec | None = None):
        if not 0 <= shard < tp:
            raise ValueError(f"{name}: shard {shard} is not a rank of TP {tp}")
        faults.activate_from_env()
        self.name, self.shard, self.tp = name, shard, tp
        self.ledger = LedgerWriter(RunDir(Path(run_dir)).ledger_file(name), worker=name, component=component)
        self.side: Any = None
        if spec is not None:
            self.configure(spec)

    def configure(self, spec: KVSpec, discard: bool = False) -> str:
        """(Re)build the pools for ``spec`` (the prefill or decode rank's); returns the device."""
        raise NotImplementedError

    def pool_sizes(self, spec: KVSpec) -> Any:
        """This rank's :class:`~harness.engines.sim.pools.PoolSizes` for ``spec`` (its KV head shard).

        Raises:
            ValueError: the TP size does not divide ``spec.kv_heads``.
        """
        from harness.engines.sim.pools import PoolSizes

        return PoolSizes(
            full_tokens=spec.full_tokens,
            swa_tokens=spec.swa_tokens,
            req_slots=spec.req_slots,
            max_context_len=spec.max_context_len,
            head_num=spec.heads_per_rank(self.tp),
        )

    def ledger_mark(self) -> int:
        """How many ledger events this worker has written."""
        return len(self.ledger.events)

    def record_config(self, config: LedgerConfig, baseline: dict[str, int]) -> None:
        """Write the ledger ``config`` event every later bound is derived from (after each configure)."""
        self.ledger.record("config", CONFIG_RID, config.page_size, **config_event(config, baseline))

    def ledger_events(self, since: int = 0) -> list[dict[str, Any]]:
        """This worker's ledger events from index ``since`` on, as JSON objects, led by the ``config``
        event in force at ``since`` (the checker derives its bounds from it)."""
        events = self.ledger.events
        head = next((e for e in reversed(events[:since]) if e.kind == "config"), None)
        return ([head.to_dict()] if head is not None else []) + [e.to_dict() for e in events[since:]]

    def peer_open(self) -> dict[str, Any]:
        """Open (or re-register after a configure) this rank's store-free transfer endpoint
        (:class:`harness.engines.sim.peer.Endpoint`); returns what a peer needs to write into its buffers."""
        if self.peer is None:
            self.peer = Endpoint()
        return self.peer.open(self.buffers)

    def peer_close(self) -> None:
        """Close the endpoint, if open (its engine's ports with it)."""
        if self.peer is not None:
            self.peer.close()
            self.peer = None

    def close(self) -> None:
        self.peer_close()
        self.ledger.close()
