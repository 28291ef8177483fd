"""rerun-test: from test names or a ``/rerun-test`` PR comment to results on the right topologies.

One module per step, each a set of pure functions except the last two:

- :mod:`.spec`      parse specs (names, paths, ``file::Class::test``, a comment body); refuse hostile input
- :mod:`.registry`  read one suite file statically (pytest markers via ``ast``), measured durations
- :mod:`.collector` the registry of every file under ``suites/`` and ``--suites-dir`` trees
- :mod:`.upstream`  sglang-style ``register_*_ci`` files and their topology map
- :mod:`.resolve`   specs → selections of registered files and tests
- :mod:`.plan`      selections → groups per topology/runner, shards, the GitHub Actions matrix
- :mod:`.comment`   the bot's status comment (idempotent per-group lines)
- :mod:`.permission` who may trigger a rerun
- :mod:`.execute`   run each group's pytest subprocess, live progress, results
- :mod:`.progress`  the pytest plugin that streams per-test results to the executor
- :mod:`.github`    the small GitHub API side the workflows in ``ci/`` call
- :mod:`.cli`       the ``rerun-test`` command
"""
