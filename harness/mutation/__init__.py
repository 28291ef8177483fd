"""Mutation score of the sglang code under test: would any test notice if these lines were wrong?

Modules: :mod:`.operators` (the mutants), :mod:`.select` (which tests reach them), :mod:`.run` (one pytest
run per mutant, the verdicts), :mod:`.score` (per function, with the survivors as diffs), :mod:`.flow` (one
whole run, map to score). ``harness mutate`` (:mod:`harness.commands.mutate`) is the front end. Each module:
docs/modules.md.
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
