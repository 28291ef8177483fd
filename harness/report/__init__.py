"""What a run tells people: its tests' results (:mod:`.results`), read from JUnit (:mod:`.junit`, the
one reader and merger) and from the run directory's per-test records (:mod:`.records`); text,
markdown and JSON summaries (:mod:`.result_tables`); the HTML page (:mod:`.page`, a jinja2 template) with
its KV-pool timelines (:mod:`.timeline`); what a run is stamped with (:mod:`.stamp`). No Ray, no
sglang.

The summary functions and the merger are re-exported here (``report.markdown(...)``).
"""

from harness.report.junit import merge_junit
from harness.report.result_tables import durations, markdown, table, to_json

__all__ = ["durations", "markdown", "merge_junit", "table", "to_json"]
