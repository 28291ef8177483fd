"""Concern plugins of the harness pytest plugin (one module per concern, listed in harness.plugin.pytest_plugins)."""
