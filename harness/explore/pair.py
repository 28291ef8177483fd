"""One in-process PD pair on sglang's real objects, driven one operation at a time: what a schedule is made of.

:class:`Pair` holds a prefill rank and a decode rank of the simulated engine (the payloads
``PrefillWorker`` / ``DecodeWorker``, built around ``PrefillSide`` / ``DecodeSide``) in this process, no Ray.
Every operation (submit, prealloc, prefill, transfer one chunk, commit, decode, abort, fail, retract, resume,
flush) goes through sglang's real path and writes the ledger; each is a :class:`Step`, so a schedule replays
exactly. :meth:`Pair.check` holds the invariants after every step, :meth:`Pair.close` those at the end;
:mod:`.machine` draws the operations. Over 400 lines: every operation acts on the same two sides' books.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from harness import ledger
from harness.explore.watch import LedgerWatch

#: Operations, in the order the readable schedule names them.
OPS = (
    "submit",
    "prealloc",
    "prefill",
    "transfer",
    "commit",
    "decode",
    "abort",
    "fail",
    "retract",
    "resume",
    "flush",
    "probe",
)
#: The request id prefix of sglang's health probes (``/health_generate`` names its request ``HEALTH_CHECK_…``).
PROBE_PREFIX = "HEALTH_CHECK_"
#: Ledger rules judged only once a run is over (mid-run, held pages are not leaks yet).
END_RULES = frozenset({"page-leak", "in-flight-at-end"})


class Broken(AssertionError):
    """An invariant does not hold: the message names it and what broke it."""


@dataclass(frozen=True)
class PairConfig:
    """The pools of one schedule (drawn per run).

    Attributes:
        page_size: tokens per page.
        window: the sliding window.
        full_pages: full-pool pages of each side.
        swa_pages: decode SWA-pool pages.
        req_slots: request slots of each side.
        radix_cache: the decode radix cache.
        eviction_interval: ``SGLANG_SWA_EVICTION_INTERVAL`` of the decode rank.
        chunk_pages: pages per transfer chunk.
        hisparse: DeepSeek-V4 pools with hisparse on the decode side (``KVSpec(kind="dsv4", hisparse=True)``).
    """

    page_size: int = 16
    window: int = 40
    full_pages: int = 24
    swa_pages: int = 10
    req_slots: int = 4
    radix_cache: bool = False
    eviction_interval: int = 1
    chunk_pages: int = 2
    hisparse: bool = False

    def spec(self) -> Any:
        """The engine's ``KVSpec`` for these pools (CPU, one KV head: small and fast)."""
        from harness.engines.sim.workload import KVSpec

        P = self.page_size
        return KVSpec(
            kind="dsv4" if self.hisparse else "swa",
            hisparse=self.hisparse,
            page_size=P,
            window=self.window,
            full_tokens=self.full_pages * P,
            swa_tokens=self.swa_pages * P,
            req_slots=self.req_slots,
            max_context_len=self.full_pages * P + 64,
            kv_heads=1,
            device="cpu",
            eviction_interval=self.eviction_interval,
            radix_cache=self.radix_cache,
        )


@dataclass(frozen=True)
class Step:
    """One operation of a schedule: its name, its arguments (request ids resolved) and what it did."""

    op: str
    args: dict[str, Any]
    outcome: str = ""

    def line(self) -> str:
        """The step as a readable line: ``prealloc r0 -> admitted, fill 66``."""
        args = " ".join(f"{v}" if k == "rid" else f"{k}={v}" for k, v in self.args.items())
        return f"{self.op} {args}".rstrip() + (f" -> {self.outcome}" if self.outcome else "")

    def to_dict(self) -> dict[str, Any]:
        return {"op": self.op, "args": dict(self.args)}


@dataclass
class _Req:
    rid: str
    prompt_len: int
    group: str
    steps: int
    dst: dict[str, Any] | None = None  # the decode prealloc's page map (on decode)
    src: dict[str, Any] | None = None  # the prefill's page map (on prefill)
    chunks: list[Any] = field(default_factory=list)
    sent: int = 0
    committed: bool = False  # its transfer completed (it decodes, or is retracted)
    running: bool = False
    retracted: bool = False


class Pair:
    """A prefill and a decode rank in this process, with the requests of one schedule.

    Args:
        config: the pools.
        run_dir: where the ranks write their ledgers (a temporary directory when None, removed on close).
    """

    def __init__(self, config: PairConfig, run_dir: Path | None = None):
        from harness.engines.sim.decode_rank import DecodeWorker
        from harness.engines.sim.prefill_rank import PrefillWorker
        from harness.targets.sglang import compat

        self.config = config
        self._scratch = run_dir is None
        self.run_dir = Path(tempfile.mkdtemp(prefix="harness-explore-")) if run_dir is None else run_dir
        for name in ("prefill-0", "decode-0"):  # a fresh ledger file per schedule (the writers append)
            (self.run_dir / "ledger" / f"{name}.jsonl").unlink(missing_ok=True)
        spec = config.spec()
        self.prefill = PrefillWorker("prefill-0", 0, spec, str(self.run_dir))
        self.decode = DecodeWorker("decode-0", 0, spec, str(self.run_dir))
        # The sim's retraction does not drive hisparse's host offload (sglang's needs a model runner).
        self.can_retract = compat.missing("decode-retraction") is None and not config.hisparse
        self.reqs: dict[str, _Req] = {}
        self.steps: list[Step] = []
        self.log: list[str] = []  # every ledger event, without its wall-clock time, in the order written
        self._seen = {"prefill": 0, "decode": 0}
        self._checked = -1  # events the ledger's rules last held over
        self._ranks_ops = 0  # operations run that reach the ranks (every one but submit)
        self._conserved = -1  # of those, how many the pools were last found conserved after
        self._watch = LedgerWatch(END_RULES)  # the rules, judged over the new events only
        self._submitted = 0
        self._probes = 0
        self._prefill_total = self._free_pages("prefill")
        self._decode_total = self._free_pages("decode")
        self._collect()

    # ---------------------------------------------------------------- what each operation may pick

    def candidates(self, op: str) -> list[str]:
        """The requests ``op`` may act on now, in a stable order (empty: the operation cannot run)."""
        pick = _PICK[op]  # (a KeyError for an operation that picks no request)
        return sorted((r.rid for r in self.reqs.values() if pick(self, r)), key=_rid_order)

    def next_op(self, rid: str) -> str:
        """The request's next operation on the way to decoding ("" once it decodes or waits on nothing)."""
        r = self.reqs[rid]
        if r.committed:
            return ""
        if r.dst is None:
            return "prealloc"
        if r.src is None:
            return "prefill"
        return "transfer" if r.sent < len(r.chunks) else "commit"

    def cached(self) -> bool:
        """Whether the decode radix cache holds anything a flush would evict."""
        tree = self.decode.side.tree_cache
        return self.config.radix_cache and (tree.full_evictable_size() + tree.swa_evictable_size()) > 0

    def _retractable(self, rid: str) -> bool:
        """Whether sglang's queue would take the request back once retracted
        (``_check_if_req_exceed_kv_capacity``: its decode reserve fits the pools; else sglang aborts it)."""
        side = self.decode.side
        req = self.decode.live[rid].req
        full, swa = side.reservation(req)
        tail = side.uses_swa_tail()
        fits = getattr(side.allocator, "prealloc_ceiling_fits", lambda f, s: None)(full, swa if tail else full)
        if fits is False:
            return False
        # And resume_retracted_reqs must be able to take it back on idle pools: its reservation (the fill plus
        # the 512-token decode reserve) within the pools' capacity. A toy pool smaller than the reserve passes
        # the capacity check above yet never resumes; a server's pools are far larger.
        return full <= side.allocator.size_full and (not tail or swa <= side.allocator.size_swa)

    def probes(self) -> int:
        """The probe steps run (one that raised included)."""
        return self._probes

    def running(self) -> list[str]:
        return [r.rid for r in self.reqs.values() if r.running]

    def retracted(self) -> list[str]:
        return [r.rid for r in self.reqs.values() if r.retracted]

    # ---------------------------------------------------------------- operations

    def apply(self, op: str, **args: Any) -> Step:
        """Run one operation by name (what a replay does); returns the recorded step (one that raises is
        recorded too, its outcome ``raised <error>``).

        Raises:
            ValueError: an unknown operation, or one that cannot run on the request named.
        """
        if op not in OPS:
            raise ValueError(f"unknown operation {op!r}; one of {', '.join(OPS)}")
        if op != "submit":  # a submit only books the request here: no rank sees it before its prealloc
            self._ranks_ops += 1
        if op == "probe":
            self._probes += 1
        try:
            outcome = getattr(self, "_" + op)(**args)
        except Exception as e:  # the step is part of the schedule that broke: a repro must hold it
            self.steps.append(Step(op, args, f"raised {type(e).__name__}"))
            self._collect()
            raise
        step = Step(op, args, outcome or "")
        self.steps.append(step)
        self._collect()
        return step

    def _submit(self, prompt_len: int, group: int, steps: int) -> str:
        rid = f"r{self._submitted}"
        self._submitted += 1
        self.reqs[rid] = _Req(rid, prompt_len, f"g{group}", steps)
        return rid

    def _get(self, rid: str, op: str) -> _Req:
        if rid not in self.candidates(op):
            raise ValueError(f"{op} {rid}: not a request this operation can act on now")
        return self.reqs[rid]

    def _prealloc(self, rid: str) -> str:
        r = self._get(rid, "prealloc")
        self._check_admission(r)
        dst = self.decode.admit(rid, r.prompt_len, r.steps, r.group)
        if dst is None:
            return "waits (no room)"
        r.dst = dst
        self._plan(r)
        return f"admitted, prefix {dst['prefix_len']}"

    def _prefill(self, rid: str) -> str:
        r = self._get(rid, "prefill")
        try:
            r.src = self.prefill.prefill(rid, r.prompt_len, r.group)
        except MemoryError:
            return "waits (prefill full)"
        self._plan(r)
        return "prefilled"

    def _check_admission(self, r: _Req) -> None:
        """sglang's admission budgets cover a request the free pools hold (``[admission-short]``, as the
        prealloc sweep checks it); judged while nothing decodes, since a running request's decode reserve
        rightly comes off the budgets.

        Raises:
            Broken: the free pools hold the request's fill and SWA tail, its budgets do not.
        """
        if self.running() or self.retracted():
            return
        from harness.engines.sim.requests import make_req

        side, P = self.decode.side, self.config.page_size
        fill = side.fill_len(make_req(r.rid, r.prompt_len, output_len=1, max_new_tokens=r.steps + 1))
        tail = side.swa_tail_len(fill)
        free = side.snapshot().free()
        need_full = -(-fill // P) * P
        need_swa = -(-tail // P) * P if side.uses_swa_tail() else fill
        if free["req_slots"] < 1 or free["full"] < need_full or free["swa"] < need_swa:
            return
        full_budget, swa_budget = side.admission_budget()
        if full_budget < need_full or (swa_budget is not None and swa_budget < need_swa):
            raise Broken(
                f"[admission-short] {r.rid}: fill {fill} (tail {tail}) fits the free pools {free}, but "
                f"admission's budgets are full {full_budget}, SWA {swa_budget}"
            )

    def _probe(self) -> str:
        """A health probe, as sglang's ``/health_generate`` sends one: a request named ``HEALTH_CHECK_…``
        with one output token, through prealloc, prefill, transfer and commit to its end, in one step."""
        rid = f"{PROBE_PREFIX}{self._submitted}"
        self._submitted += 1
        self.reqs[rid] = _Req(rid, 1, "probe", 1)
        if not self._prealloc(rid).startswith("admitted") or self._prefill(rid) != "prefilled":
            self._abort(rid)
            return f"{rid} refused (no room)"
        while rid in self.candidates("transfer"):
            self._transfer(rid)
        self._commit(rid)
        for _ in range(2):
            if rid in self.reqs:
                self._decode(1)
        return f"{rid} done" if rid not in self.reqs else f"{rid} still decoding"

    def _plan(self, r: _Req) -> None:
        from harness.engines.sim.kv_transfer import plan

        if r.src is not None and r.dst is not None:
            r.chunks = plan([r.src], [r.dst], self.config.chunk_pages)

    def _transfer(self, rid: str) -> str:
        r = self._get(rid, "transfer")
        chunk = r.chunks[r.sent]
        self.decode.write_chunk(rid, chunk.dst(), self.prefill.read_chunk(rid, chunk.src()))
        r.sent += 1
        return f"chunk {r.sent}/{len(r.chunks)}"

    def _commit(self, rid: str) -> str:
        r = self._get(rid, "commit")
        assert r.dst is not None
        self.prefill.release(rid)
        r.src = None
        self.decode.commit(rid, sorted(r.dst["full"].values()), sorted(r.dst["swa"].values()))
        r.running = r.committed = True
        return "running"

    def _decode(self, n: int) -> str:
        done: list[str] = []
        for _ in range(n):
            with self._only_running():
                done += self.decode.step()
        for rid in done:
            del self.reqs[rid]
        return f"finished {', '.join(done)}" if done else ""

    def _abort(self, rid: str) -> str:
        r = self._get(rid, "abort")
        if r.src is not None:
            self.prefill.release(rid)
        if r.dst is not None:
            self.decode.abort(rid)
        del self.reqs[rid]
        return "aborted"

    def _fail(self, rid: str) -> str:
        r = self._get(rid, "fail")
        if r.src is not None:
            self.prefill.release(rid)
        self.decode.fail(rid, f"transfer failed after {r.sent} of {len(r.chunks) or '?'} chunks")
        del self.reqs[rid]
        return "failed"

    def _retract(self, rid: str) -> str:
        r = self._get(rid, "retract")
        with self._only_running():
            self.decode.retract(rid)
        r.running, r.retracted = False, True
        return "retracted"

    def _resume(self) -> str:
        with self._only_running():
            back = self.decode.resume()
        for rid in back:
            self.reqs[rid].running, self.reqs[rid].retracted = True, False
        return f"resumed {', '.join(back)}" if back else "none resumed"

    def _flush(self) -> str:
        self.decode.drain_cache()
        return ""

    @contextlib.contextmanager
    def _only_running(self) -> Iterator[None]:
        """The decode rank sees only the running requests (a batch never holds one still in transfer)."""
        live = self.decode.live
        running = set(self.running())
        self.decode.live = {rid: lv for rid, lv in live.items() if rid in running}
        try:
            yield
        finally:
            pending = {rid: lv for rid, lv in live.items() if rid not in running}
            self.decode.live = {**pending, **self.decode.live}

    # ---------------------------------------------------------------- invariants

    def _collect(self) -> None:
        for role, worker in (("prefill", self.prefill), ("decode", self.decode)):
            for ev in worker.ledger.events[self._seen[role] :]:
                d = ev.to_dict()
                d.pop("ts", None)
                self.log.append(json.dumps(d, sort_keys=True))
            self._seen[role] = len(worker.ledger.events)

    def events(self) -> list[ledger.Event]:
        return list(self.prefill.ledger.events) + list(self.decode.ledger.events)

    def _free_pages(self, role: str) -> dict[str, frozenset[int]]:
        from harness.engines.sim.prefill_side import free_pages

        side = self.prefill.side if role == "prefill" else self.decode.side
        return free_pages(side.allocator)

    def _held(self, role: str) -> dict[str, dict[int, list[str]]]:
        """Pool -> page -> the requests whose rows hold it (decode: past their cached prefix, SWA pages
        of the live span only)."""
        P = self.config.page_size
        held: dict[str, dict[int, list[str]]] = {"full": {}, "swa": {}}
        if role == "prefill":
            side, owners = self.prefill.side, [(rid, 0) for rid in self.prefill.reqs]
            reqs = [self.prefill.reqs[rid] for rid, _ in owners]
        else:
            side = self.decode.side
            owners = [(rid, lv.prefix) for rid, lv in self.decode.live.items()]
            reqs = [self.decode.live[rid].req for rid, _ in owners]
        from harness.engines.sim.snapshot import req_state

        states = [req_state(r, side.req_to_token_pool, side.allocator, None) for r in reqs]
        for (rid, prefix), state in zip(owners, states):
            for p in {i // P for i in state.full_indices[prefix:]}:
                held["full"].setdefault(p, []).append(rid)
            floor = max(prefix, state.swa_evicted_seqlen)
            for p in {i // P for i in state.swa_indices[floor:] if i}:
                held["swa"].setdefault(p, []).append(rid)
        return held

    def check(self) -> None:
        """The invariants after a step: every pool of both ranks conserved (free + held by requests + held
        by the cache == total), no page held by two requests or both held and free, and the ledger's rules.

        Each holds as before where nothing it reads changed: the pools after submits only (they reach no
        rank), the ledger's rules without a new event.

        Raises:
            Broken: the first invariant that does not hold.
        """
        if self._ranks_ops != self._conserved:
            self._check_pools()
            self._conserved = self._ranks_ops
        if len(self.log) == self._checked:  # no new event: the rules, pure over the events, hold as before
            return
        violations = self._watch.violations((self.prefill.ledger.events, self.decode.ledger.events))
        if violations:
            raise Broken("ledger: " + "; ".join(str(v) for v in violations[:5]))
        self._checked = len(self.log)

    def _check_pools(self) -> None:
        """The pools' invariants of :meth:`check` (every problem found, in one :class:`Broken`)."""
        problems: list[str] = []
        tree = self.decode.side.tree_cache
        cached = {"full": 0, "swa": 0}
        if self.config.radix_cache:
            P = self.config.page_size
            cached = {
                "full": (tree.full_evictable_size() + tree.full_protected_size()) // P,
                "swa": (tree.swa_evictable_size() + tree.swa_protected_size()) // P,
            }
        for role, total in (("prefill", self._prefill_total), ("decode", self._decode_total)):
            free, held = self._free_pages(role), self._held(role)
            for pool in ("full", "swa"):
                two = {p: o for p, o in held[pool].items() if len(o) > 1}
                if two:
                    p = min(two)
                    problems.append(f"{role} {pool} page {p} held by {len(two[p])} requests: {', '.join(two[p])}")
                both = sorted(set(held[pool]) & free[pool])
                if both:
                    problems.append(f"{role} {pool} page(s) {both[:4]} both held by a request and free")
                extra = cached[pool] if role == "decode" else 0
                n_total = len(total[pool])
                if len(free[pool]) + len(held[pool]) + extra != n_total:
                    problems.append(
                        f"{role} {pool} pool not conserved: {len(free[pool])} free + "
                        f"{len(held[pool])} held by requests + {extra} cached != {n_total} pages"
                    )
        if problems:
            raise Broken("; ".join(problems))

    def close(self) -> None:
        """End the schedule: abort what is still in flight (resuming retracted requests first), flush the
        cache, and hold the end invariants: both ranks idle at their baseline and a clean ledger.

        Raises:
            Broken: a pool is not at its baseline, a retracted request never resumes, or the ledger breaks.
        """
        try:
            self._drain()
        finally:
            self._collect()
            for worker in (self.prefill, self.decode):
                worker.ledger.close(sync=False)  # scratch: the next schedule rewrites it (an fsync costs ms)
                worker.close()
            if self._scratch:
                shutil.rmtree(self.run_dir, ignore_errors=True)

    def _drain(self) -> None:
        for rid in [r.rid for r in self.reqs.values() if not r.retracted]:
            self._abort(rid)
        while self.retracted():  # more retracted than request slots resume a slotful at a time
            left = len(self.retracted())
            self._resume()
            if len(self.retracted()) == left:
                raise Broken(f"retracted {', '.join(self.retracted())} never resume on idle decode pools")
            for rid in [r.rid for r in self.reqs.values() if not r.retracted]:
                self._abort(rid)
        if self.config.radix_cache:
            self.decode.drain_cache()
        self._collect()
        problems = []
        if self.prefill.held():
            problems.append(f"prefill still holds {self.prefill.held()}")
        idle = self.decode.idle()
        if idle["live"] or idle["free"] != idle["baseline"]:
            problems.append(
                f"decode not at its baseline at the end: live {idle['live']}, free {idle['free']} "
                f"vs baseline {idle['baseline']}"
            )
        pfree = self.prefill.side.free_sizes()
        pbase = {k: len(v) * self.config.page_size for k, v in self._prefill_total.items()}
        if pfree != pbase:
            problems.append(f"prefill not at its baseline at the end: free {pfree} vs baseline {pbase}")
        problems += [str(v) for v in ledger.check(self.events())[:5]]
        if problems:
            raise Broken("at the end: " + "; ".join(problems))


#: Which requests each operation may act on (:meth:`Pair.candidates`).
_PICK: dict[str, Callable[[Pair, _Req], bool]] = {
    "advance": lambda pair, r: not r.committed and bool(pair.next_op(r.rid)),
    "prealloc": lambda pair, r: r.dst is None,
    "prefill": lambda pair, r: r.src is None and not r.committed,
    "transfer": lambda pair, r: bool(r.chunks) and r.sent < len(r.chunks) and not r.committed,
    "commit": lambda pair, r: r.src is not None and r.dst is not None and not r.committed and r.sent == len(r.chunks),
    "abort": lambda pair, r: not r.retracted,
    "fail": lambda pair, r: r.dst is not None and not r.committed,
    "retract": lambda pair, r: r.running and pair.can_retract and pair._retractable(r.rid),
}


def _rid_order(rid: str) -> tuple[int, int]:
    """``r3`` by its number; a probe (``HEALTH_CHECK_7``) after every ``r``."""
    return (0, int(rid[1:])) if rid[1:].isdigit() else (1, int(rid.rsplit("_", 1)[-1]))


def config_dict(config: PairConfig) -> dict[str, Any]:
    return asdict(config)
