"""Did the run test the change? Which lines of the target's ``sglang/`` package the run executed, in every
process it started, restricted to the lines a change touched.

Data flow, one module each:

    lines      the changed lines of a target: ``git diff`` of a source tree against a rev, or the
               difference between two release trees; the function each line lies in
    startmark  the coverage.py plugin every measured process loads: it records that the process started
               (so one that dies by SIGKILL is "not measured", never "lines not executed")
    measure    one run's measurement: the coverage.py configuration each group's processes start with
               (through coverage.py's own process start-up), and the combined data read back
    report     the changed-line table (per file and function, "N of M changed lines executed", the
               lines never executed, the tests that ran each), as markdown, JSON and a report-page table

Nothing here imports sglang or the harness's upper layers: it reads source text and coverage data.
"""
