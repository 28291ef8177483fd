"""``harness faults check``: every catalog fault against the suites that must catch it (the kill matrix,
:mod:`.matrix`)."""
