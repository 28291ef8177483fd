"""The router's entry point (harness.engines.server.router) takes sglang-router's own flags and
starts without importing sglang or torch (upstream's ``launch_router`` imports both through MiniLB,
about 5 CPU-s per stack start); ``--mini-lb`` still reaches upstream's module. The real router it
starts is exercised by every real-server suite."""

from __future__ import annotations

import subprocess
import sys

PROBE = """
import sys
from harness.engines.server import router
try:
    router.main(sys.argv[1:])
except SystemExit:
    pass
print("imported:", sorted(m for m in ("sglang", "torch", "sglang_router.mini_lb") if m in sys.modules))
"""


def run(*args: str) -> str:
    done = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True, timeout=120)
    return done.stdout + done.stderr


def test_rust_router_flags_parse_without_importing_sglang():
    out = run("--help")
    # sglang-router's own flags, from its RouterArgs
    assert "--pd-disaggregation" in out and "--prefill" in out and "--prometheus-port" in out, out
    assert "imported: []" in out, out


def test_mini_lb_goes_to_upstreams_launcher():
    # upstream's module parses it (and so imports MiniLB, with sglang): its own help text says so
    out = run("--mini-lb", "--help")
    assert "imported: ['sglang', 'sglang_router.mini_lb', 'torch']" in out, out[-2000:]
