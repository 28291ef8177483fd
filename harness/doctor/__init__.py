"""``harness doctor``: check a real or simulated cluster against a topology before any suite runs.

One probe actor per topology bundle is placed as a suite would place its workers; the probes read their
node and measure the network, and pure check functions turn that into rows (check, node, GPU, status,
detail, how to fix). The check families, the runner and the API: docs/modules.md.
"""

from harness.doctor import report_text as render
from harness.doctor.probe import Sources
from harness.doctor.result import CheckResult, Limits, Report, Status
from harness.doctor.runner import run

__all__ = ["CheckResult", "Limits", "Report", "Sources", "Status", "render", "run"]
