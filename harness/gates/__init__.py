"""Release qualification gates: which suites must pass where, and a verdict a release manager can act on.

One module per step (load the gate file, classify failures, decide the verdict, keep the flaky history,
write repro bundles and reports, run, reproduce); all but the runner and the reproducer are pure. The
modules in order: docs/modules.md.
"""
