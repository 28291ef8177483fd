"""rerun-test: from test names or a ``/rerun-test`` PR comment to results on the right topologies.

One module per step (parse, read the registry, resolve, plan, execute, report on the PR), each a set of
pure functions except the executor and the GitHub side. The modules in order: docs/modules.md.
"""
