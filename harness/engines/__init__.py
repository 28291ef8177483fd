"""The engines a PD pair runs on: ``sim`` (sglang's real in-process objects on simulated ranks over Ray) and
``server`` (real sglang prefill + decode + router servers). Both run the same soak through
:mod:`.interface`'s :class:`~harness.engines.interface.Engine`; :mod:`.fork_preload` is what their fork
servers import ahead.
"""
