"""The model classes of the harness's tiny CPU models, for sglang's ``SGLANG_EXTERNAL_MODEL_PACKAGE``
(set in the CPU recipe's environment, ``launcher.CPU_ENV``).

sglang's model registry otherwise imports every module of ``sglang.srt.models`` (about 150) when a
server loads its model: about 3 s of each server's start on a 2-core machine, most of it failing
imports of GPU kernels that are logged and ignored. With this package named, sglang 0.5.22 and newer
resolve an architecture it registers without importing the others (the registry's own fast path);
any other architecture still loads the whole registry, and older releases register these classes
beside the defaults. The classes are sglang's own (each module re-exports a ``sglang.srt.models``
module's ``EntryClass``): nothing of the model changes.
"""
