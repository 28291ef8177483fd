"""PD end to end on sglang's real memory paths: prefill and decode worker payloads, the KV transfer
between them, and the driver loop that runs a workload through both and writes the ledger.

Modules (one concern each):

* :mod:`harness.pd.spec` — what to run: :class:`KVSpec` (pools), :class:`PDRequest`, the seeded
  workload generator;
* :mod:`harness.pd.kvfill` — deterministic KV content ``f(request, buffer, position, shard)``,
  page gather/scatter and verification (pure torch, no sglang);
* :mod:`harness.pd.prefill` / :mod:`harness.pd.decode` — the worker payloads (one per TP rank);
* :mod:`harness.pd.transfer` — chunked P→D page transfer with a bound on bytes in flight;
* :mod:`harness.pd.peer` — the store-free transport (Mooncake, rank to rank) and its fallback to
  Ray's object store (``HARNESS_PD_TRANSPORT``);
* :mod:`harness.pd.run` — the driver: admission (requests wait in the prealloc queue), transfer,
  batched decode steps, aborts, and the result with the ledger's verdict;
* :mod:`harness.pd.deploy` — placing the rank workers of a topology on a Ray cluster.
"""
