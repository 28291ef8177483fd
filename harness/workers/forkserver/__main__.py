"""``python -m harness.workers.forkserver``: the fork server process (:mod:`.serve`)."""

import sys

from harness.workers.forkserver.serve import main

sys.exit(main())
