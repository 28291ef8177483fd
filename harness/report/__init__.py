"""What a run tells people: its results read back (:mod:`.results`), JUnit / markdown / JSON summaries
(:mod:`.summary`), the HTML page (:mod:`.page`) with its KV-pool timelines (:mod:`.timeline`), and
what a run is stamped with (:mod:`.stamp`). No Ray, no sglang.

The summary functions are re-exported here (``report.markdown(...)``).
"""

from harness.report.summary import durations, markdown, merge_junit, table, to_json

__all__ = ["durations", "markdown", "merge_junit", "table", "to_json"]
