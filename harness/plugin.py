"""pytest plugin of the harness (installed through the ``pytest11`` entry point ``pd_harness``).

This module is only the entry point: each concern is a plugin module of its own under
``harness/plugins/``, registered through :data:`pytest_plugins` below (its docstring says what it
adds):

    options    ``--topology``, ``--simulate``/``--no-simulate``, ``--ray-address``, ``--run-dir`` and
               their ini keys; the resolved :class:`~harness.plugins.options.Settings` (``settings(config)``)
    target     the sglang under test (``--sglang``): resolved and put on every process's import path
               before any conftest imports sglang; named in the header and JUnit properties
    state      the session's :class:`~harness.plugins.state.HarnessState` (run dir, cluster,
               simulate/skip decisions, unique worker names, watchdog; ``state(config)``), stale
               process reaping, the report header
    failfast   a worker's death fails the test that owns it (``WorkerDied`` through SIGUSR2, never
               ``os._exit``), log tails on failure; ``own_workers(item, workers)``
    explain    every failure's first line from its evidence: the class, the broken rule, the request,
               the suspect sglang function (pytest's summary line and the JUnit message)
    topology   markers ``topology(*names)`` and ``est_time(seconds)``, parametrization over
               topologies, fixture ``topology``
    cluster    fixtures ``run_dir``, ``ray_cluster``, ``pd_workers``
    engine     ``--engine``, ``--model``, marker ``engine`` (which tests run, which models servers get)
    servers    fixtures ``sglang_servers``, ``tiny_model`` (real sglang server stacks)
    pd         fixtures ``pd_pair``, ``pd_report``
    seeds      ``--workload-seed``, fixtures ``workload_seed``, ``workload_rng``, failed-test records
    soak       ``--soak N``, fixture ``soak_requests``
    faults     ``--inject-fault``
    record     ``<run_dir>/tests.jsonl``: per test its outcome, seeds, workers and the bytes of
               their logs and ledgers it wrote (what the run report shows per test)
    parallel   pytest-xdist groups: tests sharing the session's servers or PD pairs run in one
               worker process, the others with their module; ``-n auto`` workers
    coverage   with ``rerun-test --coverage``: each test's phases under its node id as coverage.py's
               dynamic context (which test ran a changed line of the target)

Order matters: ``options`` first (it creates the ``pd-harness`` option group the others add to);
the core concerns before the others, so their hooks keep their place (pytest calls the last
registered first: the core's ``pytest_configure`` after the others', its report header line first).
"""

from __future__ import annotations

#: Concern plugins (``harness/plugins/<concern>.py``) loaded with this one: add one line each.
pytest_plugins: list[str] = [
    "harness.plugins.options",
    "harness.plugins.target",
    "harness.plugins.state",
    "harness.plugins.failfast",
    "harness.plugins.explain",
    "harness.plugins.topology",
    "harness.plugins.cluster",
    "harness.plugins.engine",
    "harness.plugins.servers",
    "harness.plugins.pd",
    "harness.plugins.seeds",
    "harness.plugins.soak",
    "harness.plugins.faults",
    "harness.plugins.record",
    "harness.plugins.parallel",
    "harness.plugins.coverage",
]
