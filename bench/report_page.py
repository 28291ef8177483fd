"""The run report of a 200-request PD run: how long it takes to write, how heavy it is, how fast it loads.

It builds a run directory with a real 1P1D run's ledger, renders the page and opens it in headless Chromium,
printing ``write_s``, ``page_bytes``, ``png_bytes``, ``load_s`` and the load ratio to a blank page as JSON.
Detail: docs/modules.md.

Usage: ``.venv/bin/python bench/report_page.py [--requests 200] [--decode-steps 40] [--repeat 5]``
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

# The imports below need the sys.path lines above (the script runs as a file, from any directory).
from harness import ledger  # noqa: E402
from harness.report import page as html_report  # noqa: E402
from harness import rundir  # noqa: E402
from harness.report import results  # noqa: E402

PAGE, WINDOW = 64, 100


def _events(n: int, steps: int, seed: int) -> dict[str, list[ledger.Event]]:
    """A PD run's ledger: ``n`` requests, up to 8 decoding at once, each ``steps`` decode steps."""
    rng = random.Random(seed)
    out: dict[str, list[ledger.Event]] = {"prefill-r0": [], "decode-r0": []}
    free = {"prefill-r0": list(range(1, 100_000)), "decode-r0": list(range(1, 100_000))}
    t = 1000.0

    def rec(worker: str, kind: str, rid: str, pages: dict, **kw) -> None:
        nonlocal t
        t += 0.0005
        evs = out[worker]
        evs.append(
            ledger.Event(
                seq=len(evs),
                ts=t,
                kind=kind,
                rid=rid,
                component=worker.split("-")[0],
                worker=worker,
                page_size=PAGE,
                window=WINDOW if worker.startswith("decode") else None,
                pages=pages,
                **kw,
            )
        )

    def take(worker: str, k: int) -> tuple[int, ...]:
        return tuple(free[worker].pop(0) for _ in range(k))

    running: list[dict] = []
    for i in range(n):
        rid, prompt = f"r{i}", rng.randint(20, 600)
        pages = -(-prompt // PAGE)
        full, swa = take("prefill-r0", pages), take("prefill-r0", pages)
        rec("prefill-r0", "prealloc", rid, {"full": full, "swa": swa}, fill_len=prompt)
        rec("prefill-r0", "transfer", rid, {"full": full, "swa": swa})
        rec("prefill-r0", "release", rid, {"full": full, "swa": swa})
        tail = min(prompt, ((WINDOW + PAGE - 1) // PAGE + 1) * PAGE)
        dfull, dswa = take("decode-r0", pages), take("decode-r0", -(-tail // PAGE))
        rec("decode-r0", "prealloc", rid, {"full": dfull, "swa": dswa}, fill_len=prompt)
        rec("decode-r0", "transfer", rid, {"full": dfull, "swa": dswa})
        running.append({"rid": rid, "pos": prompt, "full": list(dfull), "swa": list(dswa), "left": steps})
        while len(running) >= 8 or (i == n - 1 and running):
            for r in list(running):
                r["pos"] += 1
                r["left"] -= 1
                if r["pos"] % PAGE == 0:
                    if len(r["swa"]) >= 3:  # the window slid past a page: free it before taking the next
                        old = (r["swa"].pop(0),)
                        rec("decode-r0", "evict", r["rid"], {"swa": old}, evicted_seqlen=(r["pos"] // PAGE - 2) * PAGE)
                    f, s = take("decode-r0", 1), take("decode-r0", 1)
                    r["full"] += f
                    r["swa"] += s
                    rec("decode-r0", "decode_alloc", r["rid"], {"full": f, "swa": s}, fill_len=r["pos"])
                if r["left"] == 0:
                    rec("decode-r0", "release", r["rid"], {"full": tuple(r["full"]), "swa": tuple(r["swa"])})
                    running.remove(r)
    return out


def _run_dir(base: Path, events: dict[str, list[ledger.Event]]) -> results.GroupResult:
    gdir = base / "groups" / "cpu"
    spans = {}
    for worker, evs in events.items():
        p = gdir / "ledger" / f"{worker}.jsonl"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text("".join(e.to_json() + "\n" for e in evs))
        spans[f"ledger/{worker}.jsonl"] = [0, p.stat().st_size]
    rec = {
        "path": "/x/suites/pd/test_bench.py",
        "suffix": "::test_200_requests",
        "outcome": "passed",
        "start": 0,
        "stop": 1,
        "ledgers": spans,
    }
    (gdir / rundir.RECORD_FILE).write_text(json.dumps(rec) + "\n")
    case = results.CaseResult("suites/pd/test_bench.py::test_200_requests", "passed", 1.0)
    return results.GroupResult("cpu", "cpu", "ubuntu-latest", (case,), 1.0, 0, properties=(("run_dir", str(gdir)),))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--decode-steps", type=int, default=40)
    p.add_argument("--repeat", type=int, default=5)
    args = p.parse_args(argv)
    import browser

    events = _events(args.requests, args.decode_steps, seed=1)
    n_events = sum(len(v) for v in events.values())
    violations = ledger.check([e for v in events.values() for e in v])
    with tempfile.TemporaryDirectory(prefix="bench-report-") as tmp:
        base = Path(tmp)
        group = _run_dir(base, events)
        t0 = time.perf_counter()
        page = html_report.write(base / "report", html_report.Header("rerun-test", passed=True), [group])
        write_s = time.perf_counter() - t0
        png = next((base / "report" / html_report.TIMELINES).glob("*.png"))
        blank = base / "blank.html"
        blank.write_text(f'<!DOCTYPE html><html><body><h1>x</h1><img src="{png.as_uri()}" width="10"></body></html>')
        loads, blanks = [], []
        with browser.chromium() as tab:
            for _ in range(args.repeat):
                for target, sink in ((blank, blanks), (page, loads)):
                    start = time.perf_counter()
                    tab.open(target.as_uri())
                    sink.append(time.perf_counter() - start)
            widths = tab.evaluate("[...document.querySelectorAll('img.timeline')].map(i => i.naturalWidth)")
            errors = list(tab.errors)
        load, blank_load = statistics.median(loads), statistics.median(blanks)
        print(
            json.dumps(
                {
                    "requests": args.requests,
                    "ledger_events": n_events,
                    "violations": len(violations),
                    "write_s": round(write_s, 3),
                    "page_bytes": page.stat().st_size,
                    "png_bytes": png.stat().st_size,
                    "load_s": round(load, 3),
                    "blank_load_s": round(blank_load, 3),
                    "load_ratio_to_blank": round(load / blank_load, 2),
                    "images_rendered": widths,
                    "console_errors": errors,
                },
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
