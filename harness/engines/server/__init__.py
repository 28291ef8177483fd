"""Real sglang servers: the prefill + decode + router stack as subprocess payloads of Ray workers.

Modules (none imports sglang at import time; the server-side ones run inside the servers):

* :mod:`.launcher` — topology role → exact ``sglang.launch_server`` / ``sglang_router`` argv and env;
* :mod:`.stack` — start the PD stack (and a plain baseline server) as Ray workers, readiness included;
* :mod:`.client` — HTTP client (generate, health, server info, loads, metrics, flush cache, workers);
* :mod:`.soak` — the soak (:mod:`harness.engines.soak_driver`) on a started stack: requests, aborts, checkpoints;
* :mod:`.layout` — where server processes sit on a topology's GPUs (one bundle per server), plain baseline;
* :mod:`.rdma` — a GPU server's ``--disaggregation-ib-device`` for the GPUs Ray gave it;
* :mod:`.showcmd` — a topology's stack commands as they would run, shown without starting anything;
* :mod:`.models` — tiny random-weight Llama and Mellum (hybrid SWA) models built locally;
* :mod:`.modelmap` — logical model name → local directory (``--model``, ``HARNESS_MODEL_*``, tiny on cpu);
* :mod:`.compat` — the named CPU compat patches; :mod:`.probe` — the accounting probe;
  :mod:`.hooks` — the import-time hook both use;
* ``pythonpath/site`` (``sitecustomize``, on every server's PYTHONPATH) and ``pythonpath/cpu``
  (the import-only ``sgl_kernel`` shim, CPU topologies only).
"""
