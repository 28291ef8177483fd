"""``rerun-test``'s command line: its options, the specs and run options they (or a ``/rerun-test``
comment, or a ``--plan-entry``) ask for, and the checks on their values; bad input is
:class:`UsageError` (one line, exit 2). What the command then does is :mod:`harness.commands.rerun`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from harness.commands import add_version, check_seconds
from harness.rerun import comment, spec_grammar
from harness.rundir import REPO_ROOT
from harness.targets.sglang import selection as target_mod

PROG = "rerun-test"


class UsageError(Exception):
    """Bad input: one line, exit 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line instead of usage + message
        raise UsageError(f"{message}; see {PROG} --help")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog=PROG, description="Run tests by name or from a /rerun-test PR comment on the topologies they declare."
    )
    add_version(p, PROG)
    p.add_argument(
        "specs",
        nargs="*",
        metavar="SPEC",
        help="test_x.py, path/test_x.py, file::Class::test, file::Class.test, or a whole '/rerun-test …' comment",
    )
    p.add_argument("--comment-file", type=Path, help="read a /rerun-test comment body from this file")
    p.add_argument("--plan-entry", metavar="JSON", help="run exactly one entry of a --dry-run matrix (CI)")
    p.add_argument(
        "--parse-only",
        action="store_true",
        help="only validate the specs (no repository lookup) and print them on one line; the bot's first check",
    )
    p.add_argument("--dry-run", action="store_true", help="print the plan as a GitHub Actions matrix (JSON) and exit")
    p.add_argument(
        "--github-output",
        type=Path,
        metavar="FILE",
        help="with --dry-run: append matrix=<json> to this file "
        "($GITHUB_OUTPUT); with --parse-only: specs=<the specs on one line>",
    )
    p.add_argument("--list", action="store_true", help="list registered suite files and exit")
    p.add_argument(
        "--show-commands",
        action="append",
        default=[],
        metavar="TOPOLOGY",
        help="print the command line (env, device, TP/DP, transfer backend, RDMA devices, ports) each "
        "server role of TOPOLOGY's PD stack would run, and exit; starts nothing; repeatable",
    )
    p.add_argument(
        "--from",
        dest="from_repro",
        type=Path,
        metavar="REPRO",
        help="rerun the failing test of a repro.json "
        "(from `harness gate run`) with its seeds, or replay the schedule of an explore-repro.json "
        "(from `harness explore`); exit 1 if it fails again",
    )
    p.add_argument(
        "--suites-dir",
        type=Path,
        action="append",
        default=[],
        metavar="DIR",
        help="an extra test tree (e.g. sglang's test/registered); repeatable",
    )
    p.add_argument("--repo-root", type=Path, default=REPO_ROOT, help=argparse.SUPPRESS)
    p.add_argument(
        "--durations",
        type=Path,
        action="append",
        default=[],
        metavar="FILE",
        help="measured durations JSON; repeatable",
    )
    p.add_argument(
        "--save-durations",
        action="store_true",
        help="merge this run's measured durations into suites/durations.json (commit it to share them)",
    )
    p.add_argument("--shards", type=int, default=1, help="split each group into N shards by est_time")
    p.add_argument("--shard-index", type=int, help="run only this shard (0-based)")
    p.add_argument(
        "--max-shard-time", type=float, metavar="S", help="with --dry-run: shard groups longer than S seconds"
    )
    p.add_argument(
        "--engine",
        choices=("all", "sim", "sglang-server"),
        default="all",
        help="run only the simulated suites (sim) or only the real sglang server suites; default all: "
        "a file named whole also runs the files it pairs with (simulated PD ↔ real server stack)",
    )
    p.add_argument("--run-dir", type=Path, help="where results go (default: runs/<timestamp>-<pid>)")
    p.add_argument("--ray-address", help="join this Ray cluster instead of a local one per group")
    p.add_argument("--sglang", metavar="TARGET", help=target_mod.HELP)
    p.add_argument(
        "--gpus",
        type=int,
        help="real GPUs available (default: what nvidia-smi lists; with --ray-address: "
        "unknown, so groups run one at a time unless given)",
    )
    p.add_argument("--jobs", type=int, help="most groups at once (default: min(4, CPUs))")
    p.add_argument("--timeout", type=float, metavar="S", help="seconds per group")
    p.add_argument(
        "--comment-out", type=Path, metavar="FILE", help="write/update the bot's status comment (markdown) here"
    )
    p.add_argument("--link", default=comment.LINK_PLACEHOLDER, help="URL for the comment's logs links")
    p.add_argument(
        "--coverage",
        action="store_true",
        help="measure which lines of the target's sglang/ ran, in every process of every group "
        "(data: <run>/coverage/combined.coverage)",
    )
    p.add_argument(
        "--mutate",
        action="store_true",
        help="after the groups, run `harness mutate` on the functions --changed names (default: the PD "
        "prealloc / SWA set) against the same target; the score and survivors go into --comment-out",
    )
    p.add_argument(
        "--mutate-detached",
        type=Path,
        metavar="DIR",
        help="with --mutate: start the mutation run in the background (harness.rerun.checkpoint: its "
        "output, pid and exit status under DIR) and return after the groups; the CI workflow's "
        "checkpoint steps hand its progress out and `python -m harness.rerun.checkpoint finish "
        "--dir DIR` waits for it",
    )
    p.add_argument(
        "--changed",
        metavar="BASE",
        help="with --coverage (implied): report only the lines that differ from BASE (a git rev of a "
        "tree target's checkout; for a release or wheel, another TARGET such as 0.5.22)",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    return p


def check(args: argparse.Namespace) -> None:
    """The values argparse cannot check.

    Raises:
        UsageError: one names the option, what it must be and what to do.
    """
    if args.jobs is not None and args.jobs < 1:
        raise UsageError(
            f"--jobs {args.jobs}: must be ≥ 1 (the most groups run at once); leave it out for min(4, CPUs)"
        )
    if args.gpus is not None and args.gpus < 0:
        raise UsageError(f"--gpus {args.gpus}: must be ≥ 0 (the real GPUs this machine has)")
    if args.timeout is not None and args.timeout <= 0:
        raise UsageError(f"--timeout {args.timeout:g}: must be > 0 seconds per group")
    check_seconds(args.timeout, "--timeout")
    check_seconds(args.max_shard_time, "--max-shard-time")
    if args.shard_index is not None and args.shards < 2:
        raise UsageError("--shard-index needs --shards N with N ≥ 2")


def specs_of(args: argparse.Namespace) -> tuple[list[spec_grammar.Spec], dict | None]:
    """Specs from the positional arguments, ``--comment-file`` and ``--plan-entry`` (all validated).

    A comment's options (``--coverage``, ``--changed=REV``, ``--mutate``) and a plan entry's
    ``coverage`` / ``changed`` / ``mutate`` are set on ``args`` as the same command-line options
    would be (:func:`options_of` reads them back for the plan's matrix and the spec line)."""
    options: dict = {}
    specs = spec_grammar.parse_specs(list(args.specs), options)
    if args.comment_file:
        try:
            body = args.comment_file.read_text(encoding="utf-8", errors="replace")
        except OSError as e:
            raise UsageError(
                f"--comment-file: cannot read {args.comment_file} ({e.strerror}); pass an existing file"
            ) from None
        comment_specs, comment_options = spec_grammar.parse_command(body)
        specs += [s for s in comment_specs if s not in specs]
        options.update(comment_options)
    entry = None
    if args.plan_entry:
        try:
            entry = json.loads(args.plan_entry)
            if not isinstance(entry.get("topology"), str) or not all(isinstance(t, str) for t in entry["specs"]):
                raise TypeError
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
            raise UsageError(
                "--plan-entry: not a matrix entry from --dry-run; pass one of its 'include' objects"
            ) from None
        specs += [s for s in spec_grammar.parse_specs(list(entry["specs"])) if s not in specs]
        if entry.get("coverage"):
            options["coverage"] = True
        if entry.get("changed"):
            options.update(coverage=True, changed=str(entry["changed"]))
        if entry.get("mutate"):
            options["mutate"] = True
    args.coverage = args.coverage or bool(options.get("coverage"))
    args.mutate = args.mutate or bool(options.get("mutate"))
    args.changed = args.changed or options.get("changed")
    return specs, entry


def options_of(args: argparse.Namespace) -> dict:
    """What the run asks besides tests, as a matrix entry carries it (``--plan-entry`` applies it)."""
    return {"coverage": bool(args.coverage), "changed": args.changed or "", "mutate": bool(args.mutate)}


def option_tokens(options: dict) -> list[str]:
    """:func:`options_of` as comment tokens again (``--parse-only``'s line is re-parsed by the workflow)."""
    tokens = ["--mutate"] if options["mutate"] else []
    if options["changed"]:
        return [*tokens, f"--changed={options['changed']}"]
    return [*tokens, "--coverage"] if options["coverage"] else tokens
