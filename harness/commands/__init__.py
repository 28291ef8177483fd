"""Sub-commands of the ``harness`` CLI (see ``harness.cli``)."""
