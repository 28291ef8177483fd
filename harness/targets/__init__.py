"""Adapters for the serving engines under test; one subpackage per engine (``sglang``).

An adapter is the only place that imports its engine's internals: it pins the engine version,
builds the engine's real objects and names its operations after the real code paths it drives.
"""
