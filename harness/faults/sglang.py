"""The sglang faults of the catalog: one :class:`~harness.faults.fault.Fault` entry per deliberate breakage.

Each is a source patch (``harness/faults/patches/<name>.diff``) with a marker line proving it ran, and names
the evidence its catch must show and the smallest suite selection that carries it. How to add a fault:
docs/modules.md.
"""

from __future__ import annotations

from harness.faults.fault import Fault

_LEDGER = "suites/unit/disaggregation/test_decode_prealloc_ledger.py"
_SWEEP = "suites/unit/disaggregation/test_swa_prealloc_accounting.py::test_swa_prealloc_accounting_sweep"
_RESERVATION = "suites/unit/disaggregation/test_decode_reservation.py"
_RECLAIM = "suites/unit/disaggregation/test_decode_radix_swa_reclaim.py"
# The PD pair over (simulated) Ray: decode steps and the P->D page transfer run only there.
_PD = "suites/disaggregation/test_disaggregation_basic.py"
_PD_MIXED = f"{_PD}::test_mixed_prompt_lengths_around_page_boundaries"
_PD_CONCURRENT = f"{_PD}::test_concurrent_requests_decode_together"
# The simulated engine's failed transfer, through sglang's own DecodeTransferQueue.pop_transferred.
_PD_FAILED_TRANSFER = f"{_PD}::test_failed_transfer_mid_flight_decode_releases_what_it_preallocated"
# The real prefill + decode + router stack of the SWA model: its decode ledger (prealloc, decode-time
# eviction, release) and its failure paths (a failed or aborted transfer).
_SWA_SERVER_LEDGER = "suites/disaggregation/test_disaggregation_swa_server.py::test_decode_ledger_holds_swa_invariants"
# The same stack decoding through one SWA eviction: its greedy output against the plain server's.
_SWA_SERVER_WINDOW = (
    "suites/disaggregation/test_disaggregation_swa_server.py::test_decode_through_an_swa_eviction_matches_plain"
)
#: sglang's checks but its idle memory check, which stops a server at its first idle moment after a
#: leak, before the harness's oracle can look.
_ALL_BUT_IDLE = "invariant-strict,mem-check-busy,kv-page-invariants,debug-memory-pool"
_FAILURE_PATHS = "suites/disaggregation/test_disaggregation_failure_paths_server.py"
_ABORT_IN_FLIGHT = f"{_FAILURE_PATHS}::test_abort_while_kv_in_flight_frees_both_sides"
_PREFILL_KILLED = f"{_FAILURE_PATHS}::test_prefill_killed_while_kv_in_flight_decode_releases"
# A decode pool so tight that admission rations it: what admission charged, against each prealloc.
_ADMISSION = f"{_FAILURE_PATHS}::test_admission_rations_a_tight_decode_pool_and_charges_whole_pages"
_HEALTH = f"{_FAILURE_PATHS}::test_health_probes_repeated_leave_no_kv"
_RETRACTION = f"{_FAILURE_PATHS}::test_retraction_under_decode_pool_pressure_resumes_and_leaves_no_kv"
_DECODE_KILLED = f"{_FAILURE_PATHS}::test_decode_killed_while_prefill_holds_kv_prefill_releases"
_BAD_BOOTSTRAP = f"{_FAILURE_PATHS}::test_malformed_bootstrap_address_fails_the_request_not_the_server"
# The simulated engine's retraction, through sglang's own release_req and resume_retracted_reqs.
_PD_RETRACTION = f"{_PD}::test_retraction_resumes_with_its_kv_restored_and_leaves_no_kv"
# Heterogeneous PD (unequal TP, DP attention) on the simulated engine: sglang's mooncake code plans the moves.
_HETERO = "suites/disaggregation/test_disaggregation_hetero_tp.py"
_HETERO_HEADS = f"{_HETERO}::test_each_decode_rank_receives_exactly_the_kv_heads_it_owns"
_HETERO_DP = f"{_HETERO}::test_dp_attention_kv_comes_from_the_prefill_dp_rank_the_receiver_is_bound_to"
# KV in flight on the real stack: holds inside a chunk write, an abort against it.
_INFLIGHT = "suites/disaggregation/test_disaggregation_inflight_server.py"
_ACK_WAIT = f"{_INFLIGHT}::test_a_deferred_release_waits_for_prefills_drain_ack"
# Chunked prefill on the real stack (one page per chunk): each chunk sent after its forward, per the trace.
_CHUNKED = "suites/disaggregation/test_disaggregation_chunked_server.py"
_CHUNK_ORDER = f"{_CHUNKED}::test_each_chunk_is_sent_after_its_forward_and_lands_as_sent"

#: Content and window verification of the PD decode ranks (every byte of every request).
_CONTENT = ("KVCorruption", "WindowLost")

FAULTS: tuple[Fault, ...] = (
    Fault(
        name="swa-tail-unaligned",
        description="_swa_tail_len no longer floors the window start to a page (and the asserts pinning it are gone)",
        upstream="sglang#35286 / sglang#35396",
        evidence=("[evicted-unaligned]", *_CONTENT),
        suites=(_LEDGER,),
        est_s=4,
    ),
    Fault(
        name="swa-tail-short",
        description="_swa_tail_len rounds the window start up to a page: the tail stays aligned but loses the window",
        upstream="sglang#35286 / sglang#35396 class (tail rounding)",
        evidence=("[swa-tail-short]", "[swa-window-lost]", "WindowLost"),
        suites=(_LEDGER, _SWA_SERVER_LEDGER),
        est_s=25,
    ),
    Fault(
        name="release-leaks-swa",
        description="release frees a request's live SWA segments on the full side only, leaking its SWA pages",
        upstream="sglang#27789 / sglang#36081 (SWA pool page leaks)",
        evidence=("[page-leak]", "[not-baseline]", "[free-mismatch]", "[reset-leak]"),
        suites=(_LEDGER, _SWA_SERVER_LEDGER),
        est_s=20,
        # Every release leaks: on a server sglang's idle check (at warm-up), its busy check and its
        # strict invariant level (swa.peer_released) each stop the scheduler before the ledger is read.
        sglang_checks="debug-memory-pool",
    ),
    Fault(
        name="prealloc-no-swa-evict",
        description="_pre_alloc reclaims only full-attention pages, never the evictable SWA pages admission counted",
        upstream="sglang#40309",
        evidence=("[alloc-after-admit]",),
        suites=(_RECLAIM,),
        est_s=2,
    ),
    Fault(
        name="swa-full-length",
        description="decode prealloc charges the SWA pool for the full fill length instead of the window tail",
        upstream="sglang#24036 (SWA prealloc sizing)",
        evidence=("[swa-charge]", "[evicted-mismatch]", "[alloc-after-admit]"),
        suites=(_LEDGER,),
        est_s=3,
    ),
    Fault(
        name="decode-reserve-unaligned",
        description="decode prealloc reservation (_prealloc_required_tokens) not rounded up to whole pages",
        upstream="sglang#35265",
        evidence=("[reserve-short]",),
        suites=(_RESERVATION, _ADMISSION),
        est_s=18,
    ),
    Fault(
        name="hisparse-budget-swa",
        description="hisparse decode admission budget from the SWA-clamped available size, not full logical capacity",
        upstream="sglang#30401 / sglang#30408",
        evidence=("[admission-short]",),
        suites=(_SWEEP,),
        est_s=4,
    ),
    Fault(
        name="decode-skips-swa-evict",
        description="decode steps never free SWA slots that slid out of the window",
        upstream="sglang#27789 class (SWA pool growth during decode)",
        evidence=("[swa-evict-late]", "[swa-over-window]"),
        suites=(_PD_CONCURRENT, _SWA_SERVER_LEDGER),
        est_s=35,
    ),
    Fault(
        name="swa-evict-frees-window",
        description="decode's SWA eviction frees a page past the floor it records: the page holding the window",
        upstream="none known: built for harness issue 26 (an off-by-a-page free range in free_swa_out_of_window_slots)",
        # The floor sglang records stays right: only the slots the eviction really freed show it (the
        # server probe's and the PD ranks' freed_spans, one rule for both; the PD ranks' window check
        # too). On the real stack the bytes show it too: the window's positions lost their mapping and
        # read the padding slot, and the greedy output leaves the plain server's (WindowParity).
        evidence=("[swa-window-lost]", "WindowLost", "WindowParity"),
        suites=(_PD_CONCURRENT, _SWA_SERVER_WINDOW),
        est_s=90,
        # Each of sglang's checks stops a server before the output comes back: the debug pool's
        # alloc_decode assert stops the decode the step after the eviction, the strict invariant
        # swa.peer_mapped its release, the busy check the plain baseline (measured on a 400-token prompt).
        sglang_checks="off",
    ),
    Fault(
        name="decode-skips-failed-release",
        description="decode never releases the pages it preallocated for a transfer that failed or was aborted",
        upstream="sglang#6258 / sglang#9817 / sglang#7130 (PD decode leaks after failed transfers)",
        evidence=("[page-leak]", "[reset-leak]", "[not-baseline]"),
        suites=(_PD_FAILED_TRANSFER, _ABORT_IN_FLIGHT, _PREFILL_KILLED),
        est_s=73,
        sglang_checks=_ALL_BUT_IDLE,
    ),
    Fault(
        name="health-probe-keeps-kv",
        description=(
            "a health probe's request (/health_generate, rid HEALTH_CHECK_*) is never released: "
            "its KV row, pages and tree lock stay held"
        ),
        upstream="sglang#28652 (health and warm-up requests pinning KV and tree-cache locks)",
        # The probe records the release sglang was asked for; the flush then finds its slots neither
        # free nor cached, on decode and on prefill alike.
        evidence=("[reset-leak]", "[not-baseline]", "[page-leak]"),
        suites=(_HEALTH,),
        est_s=26,
        sglang_checks=_ALL_BUT_IDLE,
    ),
    Fault(
        name="retract-skips-swa-release",
        description=(
            "a decode retraction (release_req) frees the request's live SWA segments on the full side only, "
            "leaking its SWA pages"
        ),
        upstream="sglang#40309 class (retracted requests resumed without their SWA pages reclaimed)",
        evidence=("[page-leak]", "[not-baseline]", "[reset-leak]"),
        suites=(_PD_RETRACTION, _RETRACTION),
        est_s=37,
        # Its SWA pages leak with their full peers freed: at sglang's strict invariant level
        # (swa.peer_released) the release raises half done, and the real decode's scheduler dies
        # (the test then waits minutes and its page-leak is the crash's, not the fault's).
        sglang_checks="debug-memory-pool",
    ),
    Fault(
        name="prefill-skips-failed-release",
        description=(
            "prefill never releases (nor unlocks in its tree) the KV of a request whose transfer failed "
            "(its decode died)"
        ),
        upstream="sglang#6258 / sglang#9817 class, prefill side (KV held for a transfer that can never complete)",
        evidence=("[reset-leak]", "[not-baseline]"),
        suites=(_DECODE_KILLED,),
        est_s=18,
        sglang_checks=_ALL_BUT_IDLE,
    ),
    Fault(
        name="decode-bootstrap-never-gives-up",
        description=(
            "decode never fails a request whose prefill bootstrap address it cannot reach: "
            "past its retry bound it starts the attempts over"
        ),
        upstream="sglang#40125 class (hostile bootstrap input hanging the decode scheduler's queue)",
        # No KV is ever preallocated for it: the evidence is the request hanging, which the test turns
        # into a failure of its own after a bounded wait (and aborts it).
        evidence=("hangs the request",),
        suites=(_BAD_BOOTSTRAP,),
        est_s=44,
    ),
    Fault(
        name="extend-keeps-pages-it-hands-out",
        description=(
            "the paged allocator's alloc_extend takes its new pages off the end of the free list, "
            "not the head it handed out: pages in use stay free"
        ),
        upstream="sglang#25805 class (pages both held and free: double frees of recycled pages)",
        # The pool's counts still balance (a page lost for each one kept free), so no pool identity sees
        # it: the ledger does, by page id (prefill's transfer names a page its request does not hold, or
        # a page is handed to two requests), and so do sglang's page-level checks (the KV page
        # invariants, the allocator's debug asserts: tests/test_sglang_checks_trip.py trips them with it).
        evidence=("[transfer-unowned]", "[page-double-alloc]", "KVCorruption"),
        suites=(_PD_MIXED,),
        est_s=17,
    ),
    Fault(
        name="swa-grouped-free-drops-last-page",
        description="a grouped SWA free (free_group_begin/end) never hands its last SWA page back to the free list",
        upstream="sglang#36135 / sglang#36081 (a one-page SWA leak after grouped frees)",
        evidence=("[not-baseline]", "[reset-leak]", "[free-mismatch]"),
        # The SWA server's ledger test catches it too ([reset-leak] on decode; `--all` runs it there):
        # the CI selection leaves that cell to the four faults above that need it, one stack start less.
        suites=(_PD_CONCURRENT,),
        est_s=16,
        sglang_checks=_ALL_BUT_IDLE,
    ),
    Fault(
        name="hetero-gqa-head-modulo",
        description=(
            "compute_head_slice_params maps decode ranks onto KV heads by rank, not rank // replication: with "
            "decode TP above the KV heads the shared heads cycle [0, 1, 0, 1] instead of [0, 0, 1, 1]"
        ),
        upstream="sglang#23746 (fixed by sglang#30997)",
        evidence=("should hold KV head",),
        suites=(f"{_HETERO_HEADS}[8-gpu-h100-tp1-tp4]",),
        est_s=32,
    ),
    Fault(
        name="hetero-head-slice-first-only",
        description=(
            "compute_head_slice_params hands every decode rank the source rank's first head slice: with decode TP "
            "above prefill TP, decode ranks past the first attend over another head's KV"
        ),
        upstream="sglang#23746 class (KV heads mapped to the wrong decode ranks)",
        evidence=("should hold KV head",),
        suites=(f"{_HETERO_HEADS}[8-gpu-h100-tp1-tp4]",),
        est_s=32,
    ),
    Fault(
        name="hetero-rank-map-modulo",
        description=(
            "_resolve_rank_mapping sends decode rank d (decode TP above prefill TP) to prefill rank d % prefill "
            "TP instead of d // (decode TP / prefill TP): decode ranks pull another rank's heads"
        ),
        upstream="sglang#6793 class (the decode->prefill TP rank map of different-TP PD)",
        evidence=("should hold KV head",),
        suites=(f"{_HETERO_HEADS}[8-gpu-h200-tp2-tp4]",),
        est_s=32,
    ),
    Fault(
        name="decode-dp-rank-ignores-router",
        description=(
            "_resolve_prefill_dp_rank drops the prefill DP rank the router chose (disagg_prefill_dp_rank) and "
            "binds the receiver by bootstrap room: it waits on a prefill DP rank that never had the request"
        ),
        upstream="sglang#29725 / sglang#29730 / sglang#40730 class (decode bound to the wrong prefill DP rank)",
        evidence=("NotHeld", "which it does not hold"),
        suites=(_HETERO_DP,),
        est_s=31,
    ),
    Fault(
        name="decode-releases-before-drain-ack",
        description=(
            "resolve_deferred_releases frees an aborted transfer's pages at its first pass, without waiting "
            "for prefill's drain ack or its own timeout"
        ),
        upstream="sglang#24580 / #27372 / #32564 / #38961 class (decode frees KV prefill may still write)",
        # The phase trace shows the release before prefill's (held) drain ack and before decode's own
        # timeout: reset_server's [release-before-ack].
        evidence=("[release-before-ack]",),
        suites=(_ACK_WAIT,),
        est_s=55,
    ),
    Fault(
        name="prefill-sends-chunk-before-forward",
        description=(
            "prefill's event loop sends a non-final chunk's KV (send_kv_chunk) as the chunk's batch is launched, "
            "before the forward that writes its pages, instead of after it (process_prefill_chunk)"
        ),
        upstream="sglang#33970 class (a chunk's pages read while its forward still writes them)",
        # The phase trace shows prefill.send of chunk i before prefill.forwarded of chunk i. The bytes may
        # or may not show it (the transfer races the forward), the order always does.
        evidence=("ChunkSentBeforeForward",),
        suites=(_CHUNK_ORDER,),
        est_s=78,
    ),
)
