from sglang.srt.models.mellum import EntryClass  # noqa: F401  (tiny-mellum-swa: MellumForCausalLM)
