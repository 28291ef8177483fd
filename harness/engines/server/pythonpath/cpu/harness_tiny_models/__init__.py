"""The model classes of the harness's tiny CPU models, for sglang's ``SGLANG_EXTERNAL_MODEL_PACKAGE``
(set in the CPU recipe's environment, ``launcher.CPU_ENV``).

Named, it lets sglang 0.5.22 and newer resolve these architectures without importing all of
``sglang.srt.models`` (about 3 s of each server start). The classes are sglang's own: nothing of the model
changes. Detail: docs/modules.md.
"""
