"""``harness matrix --pair P,D``: a real CPU PD stack with prefill on one sglang target and decode on another,
a short fixed check, and one verdict a pair: ``pass``, ``refusal`` (both sides fail fast with an error) or
``finding`` (anything else; a hang always is one).

Each pair runs in a child process of its own (``python -m harness.rerun.pair_matrix``: prefill's target is the
child's, so the plain baseline's too; decode's reaches the launcher through ``HARNESS_SGLANG_DECODE``), every
wait in it bounded and the child itself too. :func:`verdict` is pure; :func:`check_pair` runs the stack.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Sequence

from harness import atomic
from harness.workers import procs

#: The pair check's model (full attention, built locally) and requests: around one page, and a long one.
MODEL = "tiny-llama"
PROMPT_LENS = (20, 64, 65, 300)
MAX_NEW = 8
#: A request on this stack takes 0.4-5 s (docs: the CPU reference); past this it is a hang.
REQUEST_TIMEOUT_S = 90.0
#: The whole child (two servers' start, a plain baseline, the requests, the resets, the stop).
PAIR_TIMEOUT_S = 900.0
VERDICTS = ("pass", "refusal", "finding")
#: A server log line that reports an error (what a refusal must show on both sides).
_ERROR_LINE = re.compile(r"error|exception|mismatch|incompatib|refus|abort", re.IGNORECASE)
RESULT_FILE = "pair.json"


@dataclass(frozen=True)
class PairResult:
    """One pair's cell: its targets, verdict, one line of evidence and the wall seconds it took."""

    prefill: str
    decode: str
    verdict: str
    evidence: str
    wall_s: float
    run_dir: str = ""


@dataclass(frozen=True)
class Sent:
    """One request of the check: what plain and the pair answered (``error``: the pair's failure, one line)."""

    prompt_len: int
    want: tuple[int, ...]
    got: tuple[int, ...] | None = None
    error: str = ""
    timed_out: bool = False


def parse_pair(value: str) -> tuple[str, str]:
    """``PREFILL,DECODE`` -> the two TARGETs (the same one twice is allowed).

    Raises:
        ValueError: not exactly two non-empty targets.
    """
    parts = [p.strip() for p in value.split(",")]
    if len(parts) != 2 or not all(parts):
        raise ValueError(
            f"--pair {value!r}: give two targets, PREFILL,DECODE (e.g. --pair 0.5.21,0.5.23; the same twice is allowed)"
        )
    return parts[0], parts[1]


def prompt(n: int, seed: int = 1) -> list[int]:
    """``n`` deterministic token ids of the tiny vocabulary (no special tokens)."""
    rng = random.Random(seed * 100_003 + n)
    return [rng.randrange(4, 512) for _ in range(n)]


def error_line(text: str) -> str:
    """The first line of a server log's ``text`` that reports an error (empty when none does)."""
    return next((ln.strip() for ln in text.splitlines() if _ERROR_LINE.search(ln)), "")


def verdict(
    sent: Sequence[Sent], alive: dict[str, bool], errors: dict[str, str], reset_problems: Sequence[str]
) -> tuple[str, str]:
    """The pair's verdict and one line of evidence (pure).

    Args:
        sent: every request, in order (the check stops at the first that timed out).
        alive: ``prefill`` / ``decode`` -> whether the server still serves after the requests.
        errors: ``prefill`` / ``decode`` -> the first error line of its log since the requests began.
        reset_problems: what each server's reset (flush, ledger, baseline) reported afterwards.

    Returns:
        ``(verdict, evidence)``: ``pass`` when every request matched plain and the resets were clean;
        ``refusal`` when every request failed fast and each side logged an error; ``finding`` otherwise.
    """
    hung = [s for s in sent if s.timed_out]
    if hung:
        said = "; ".join(f"{role}: {line[:200]}" for role, line in sorted(errors.items()) if line)
        return "finding", (
            f"hang: the request of {hung[0].prompt_len} tokens had no answer in {REQUEST_TIMEOUT_S:.0f} s"
            + (f" ({said})" if said else " (no error logged)")
        )
    failed = [s for s in sent if s.error]
    if failed and len(failed) == len(sent):
        quiet = [role for role in ("prefill", "decode") if not errors.get(role)]
        if quiet:
            return "finding", f"every request failed ({failed[0].error}) but {' and '.join(quiet)} logged no error"
        return "refusal", f"{failed[0].error} | prefill: {errors['prefill'][:160]} | decode: {errors['decode'][:160]}"
    if failed:
        return (
            "finding",
            f"{len(failed)} of {len(sent)} requests failed: {failed[0].prompt_len} tokens: {failed[0].error}",
        )
    differ = [s for s in sent if s.got != s.want]
    if differ:
        s = differ[0]
        return (
            "finding",
            f"{len(differ)} of {len(sent)} differ from plain: {s.prompt_len} tokens: pair {s.got} != plain {s.want}",
        )
    dead = [role for role, up in alive.items() if not up]
    if dead:
        return "finding", f"{' and '.join(dead)} stopped serving after the requests"
    if reset_problems:
        return "finding", f"reset: {reset_problems[0]}"
    return "pass", f"{len(sent)} requests token-identical to plain; both servers back at baseline, ledgers clean"


def _log_size(path: Path) -> int:
    return path.stat().st_size if path.is_file() else 0


def _log_since(path: Path, offset: int) -> str:
    if not path.is_file():
        return ""
    with open(path, "rb") as fh:
        fh.seek(offset)
        return fh.read().decode("utf-8", errors="replace")


def check_pair(run_dir: Path, say: Callable[[str], None] = print) -> tuple[str, str]:
    """Start the stack (its targets already chosen by the environment), run the check, stop everything.

    Returns:
        ``(verdict, evidence)`` as :func:`verdict`, or a finding when the stack did not start.
    """
    import requests

    from harness import rundir, topology
    from harness.cluster import Cluster
    from harness.engines.server.http_client import ServerClient, ServerHTTPError
    from harness.engines.server.stack_pool import StackPool, counted_names
    from harness.workers import WorkerDied

    topo = topology.get("cpu")
    run = rundir.create(run_dir)
    with Cluster.start(topo) as cluster:
        pool = StackPool(cluster, topo, run, unique_name=counted_names())
        try:
            try:
                stack = pool.pd(MODEL, with_plain=True)
            except (WorkerDied, TimeoutError) as e:
                first = next((ln for ln in str(e).splitlines() if ln.strip()), repr(e))
                cause = [ln.strip() for ln in str(getattr(e, "tail", "")).splitlines() if _ERROR_LINE.search(ln)][-1:]
                return "finding", f"the stack did not start: {first[:200]}{''.join(': ' + c[:200] for c in cause)}"
            say(f"pair: stack ready in {stack.started_s:.0f} s")
            plain = ServerClient(pool.plain(MODEL).url("http"))
            router = stack.client("router")
            logs = {role: getattr(stack, role).log_path for role in ("prefill", "decode")}
            marks = {role: _log_size(p) for role, p in logs.items()}
            sent: list[Sent] = []
            for n in PROMPT_LENS:
                ids = prompt(n)
                want = plain.generate(ids, MAX_NEW, timeout_s=REQUEST_TIMEOUT_S).output_ids
                try:
                    got = router.generate(ids, MAX_NEW, timeout_s=REQUEST_TIMEOUT_S).output_ids
                    sent.append(Sent(n, want, got))
                except requests.Timeout:
                    sent.append(Sent(n, want, error="timed out", timed_out=True))
                    break
                except ServerHTTPError as e:
                    sent.append(Sent(n, want, error=f"HTTP {e.status}: {' '.join(e.body.split())[:200]}"))
                except requests.RequestException as e:
                    sent.append(Sent(n, want, error=f"{type(e).__name__}: {str(e)[:200]}"))
                say(f"pair: {n} tokens: {sent[-1].error or ('match' if sent[-1].got == want else 'DIFFER')}")
            alive = {role: getattr(stack, role).poll() is None and stack.client(role).health(10) for role in logs}
            errors = {role: error_line(_log_since(path, marks[role])) for role, path in logs.items()}
            problems = pool.reset_used() if all(alive.values()) and not any(s.timed_out for s in sent) else []
            return verdict(sent, alive, errors, problems)
        finally:
            left = pool.close()
            if left:
                say(f"pair: server processes left after the stop: {left}")


def run_pair(
    prefill: str,
    decode: str,
    run_dir: Path,
    *,
    repo_root: Path,
    timeout_s: float = PAIR_TIMEOUT_S,
    out: Callable[[str], None] = print,
) -> PairResult:
    """Run one pair's check in a child process (``timeout_s`` bounds it; past it the pair is a hang)."""
    from harness.engines.server.launcher import ROLE_TARGET_ENV
    from harness.targets.sglang.selection import ENV_VAR

    run_dir.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in (ENV_VAR, *ROLE_TARGET_ENV.values())}
    env.update({ROLE_TARGET_ENV["prefill"]: prefill, ROLE_TARGET_ENV["decode"]: decode})
    cmd = [sys.executable, "-m", __name__, "--sglang", prefill, "--run-dir", str(run_dir)]
    out(f"matrix: pair prefill {prefill} / decode {decode} (run dir {run_dir})")
    start = time.monotonic()
    log = run_dir / "pair.log"
    code, timed_out = procs.run_logged(cmd, cwd=repo_root, env=env, log=log, timeout_s=timeout_s)
    wall = time.monotonic() - start
    result_path = run_dir / RESULT_FILE
    if timed_out:
        procs.reap_stale()
        found = ("finding", f"hang: the pair check did not finish in {timeout_s:.0f} s (log {log})")
    elif result_path.is_file():
        data = json.loads(result_path.read_text(encoding="utf-8"))
        found = (data["verdict"], data["evidence"])
    else:
        lines = [ln.strip() for ln in log.read_text(encoding="utf-8", errors="replace").splitlines() if ln.strip()]
        last = ([ln for ln in lines if _ERROR_LINE.search(ln)] or lines or [""])[-1]  # its error, else its last word
        found = ("finding", f"the pair check exited {code}: {last[:300]}")
    out(f"matrix: pair prefill {prefill} / decode {decode}: {found[0]} in {wall:.0f} s")
    return PairResult(prefill, decode, found[0], found[1], wall, str(run_dir))


def render_text(results: Sequence[PairResult]) -> str:
    """The pairs as a terminal table, then each evidence line (pure)."""
    head = ["prefill", "decode", "verdict", "wall"]
    rows = [[r.prefill, r.decode, r.verdict, f"{r.wall_s:.0f}s"] for r in results]
    widths = [max(len(row[i]) for row in [head, *rows]) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in [head, *rows]]
    lines += [f"{r.prefill} -> {r.decode}: {r.evidence}" for r in results]
    return "\n".join(lines)


def render_markdown(results: Sequence[PairResult]) -> str:
    """The pairs as a markdown table (pure)."""
    lines = ["| prefill | decode | verdict | evidence | wall |", "| --- | --- | --- | --- | ---: |"]
    lines += [
        f"| {r.prefill} | {r.decode} | {r.verdict} | {r.evidence.replace('|', '/')} | {r.wall_s:.0f}s |"
        for r in results
    ]
    return "\n".join(lines) + "\n"


def to_json(results: Sequence[PairResult]) -> dict:
    """JSON-able pairs (pure)."""
    return {"pairs": [{**asdict(r), "wall_s": round(r.wall_s, 1)} for r in results]}


def main(argv: Sequence[str] | None = None) -> int:
    """The child: select prefill's target here, run :func:`check_pair`, write ``pair.json``."""
    import logging

    from harness.targets.sglang import selection

    p = argparse.ArgumentParser(prog="harness.rerun.pair_matrix")
    p.add_argument("--sglang", required=True)
    p.add_argument("--run-dir", type=Path, required=True)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    selection.select_for_cli(args.sglang, "pair")
    found, evidence = check_pair(args.run_dir)
    atomic.write_json(args.run_dir / RESULT_FILE, {"verdict": found, "evidence": evidence})
    print(f"pair: {found}: {evidence}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
