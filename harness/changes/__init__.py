"""Did the run test the change? Which lines of the target's ``sglang/`` package the run executed, in every
process it started, restricted to the lines a change touched.

Data flow, one module each: :mod:`.lines` → :mod:`.startmark` → :mod:`.measure` → :mod:`.report`. Nothing
here imports sglang or the harness's upper layers: it reads source text and coverage data. What each
module does: docs/modules.md.
"""
