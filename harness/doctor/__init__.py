"""``harness doctor``: check a real or simulated cluster against a topology before any suite runs.

One probe actor per topology bundle is placed exactly as a suite would place its workers; the probes
read their node and measure the network, and pure check functions turn that into rows (check, node,
GPU, status, detail, how to fix). Families, one module each: :mod:`~harness.doctor.placement`,
:mod:`~harness.doctor.gpu`, :mod:`~harness.doctor.software`, :mod:`~harness.doctor.network`,
:mod:`~harness.doctor.host`; :mod:`~harness.doctor.runner` asks with per-check timeouts (a hung probe
is reported, never waited on forever); :mod:`~harness.doctor.render` prints the table or JSON.

API::

    from harness import topology
    from harness.doctor import Limits, Sources, run, render

    report = run(topology.get("2-gpu-h100"), simulate=True, run_dir="runs/x")
    print(render.table(report)); sys.exit(report.exit_code)
"""

from harness.doctor import render
from harness.doctor.probe import Sources
from harness.doctor.result import CheckResult, Limits, Report, Status
from harness.doctor.runner import run

__all__ = ["CheckResult", "Limits", "Report", "Sources", "Status", "render", "run"]
