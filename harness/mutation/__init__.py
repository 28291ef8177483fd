"""Mutation score of the sglang code under test: would any test notice if these lines were wrong?

    operators  mutants of one function (standard operators and the engine's own: ± a page, floor <-> ceil)
    select     which tests reach a mutant's lines: one measured run of the candidate tests
               (:mod:`harness.changes.measure`), each test's own lines by its dynamic context
    run        each mutant as a scratch copy of the target with the one file changed and a fired
               marker, its selected tests forked from the third-party preload; the verdicts
    score      killed / survived / timeout / not covered per function, the survivors as diffs,
               markdown and the report-page tables

``harness mutate`` (:mod:`harness.commands.mutate`) is the front end.
"""

#: The default functions (sglang 0.5.23 names): the PD decode prealloc and SWA eviction / free paths.
DEFAULT_FUNCTIONS = (
    "sglang.srt.disaggregation.decode:DecodePreallocQueue._swa_tail_len",
    "sglang.srt.disaggregation.decode:DecodePreallocQueue._prealloc_required_tokens",
    "sglang.srt.disaggregation.decode:alloc_for_decode_prealloc",
    "sglang.srt.disaggregation.decode:alloc_for_decode_prealloc_hisparse",
    "sglang.srt.managers.schedule_batch:ScheduleBatch.maybe_evict_swa",
    "sglang.srt.managers.schedule_batch:ScheduleBatch._evict_swa",
    "sglang.srt.mem_cache.allocator.swa:SWATokenToKVPoolAllocator.free",
    "sglang.srt.mem_cache.allocator.swa:SWATokenToKVPoolAllocator.free_swa",
    "sglang.srt.mem_cache.allocator.swa:SWATokenToKVPoolAllocator._free_swa_pages",
)
