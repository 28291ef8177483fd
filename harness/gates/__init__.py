"""Release qualification gates: which suites must pass where, and a verdict a release manager can act on.

One module per step; all but the last two are pure:

- :mod:`.model`     gate files (``ci/gates/NAME.toml``): load and validate (one :class:`GateError`
                    naming file, key and fix)
- :mod:`.classify`  a failure's class (crash, import, timeout, accounting, accuracy, timing, assertion,
                    error) from its JUnit element; whether the flaky policy may rerun it
- :mod:`.verdict`   per-suite outcomes → PASS / FAIL with the reasons
- :mod:`.history`   the flaky record: per-test outcomes appended per run; tests between 0 and 100 %
- :mod:`.repro`     repro bundles (``repro.json``): build, load, compare environments
- :mod:`.render`    summary.md / result.json / merged JUnit of a gate run
- :mod:`.runner`    run a gate through rerun-test's machinery (resolve → plan → execute), reruns of
                    flaky-classified failures, reports, repro bundles, history
- :mod:`.reproduce` ``rerun-test --from repro.json``: rerun one failing test with its seeds
"""
