"""Real sglang servers: the prefill + decode + router stack as subprocess payloads of Ray workers.

None of its modules imports sglang at import time; the server-side ones (the probe, the patches, the hold)
run inside the servers. The modules, one line each: docs/modules.md.
"""
