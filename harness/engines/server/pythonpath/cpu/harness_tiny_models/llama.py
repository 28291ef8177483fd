from sglang.srt.models.llama import EntryClass  # noqa: F401  (tiny-llama: LlamaForCausalLM)
