"""PD-disaggregation test harness: topologies -> Ray placement -> workers -> sglang -> ledger -> report."""

__version__ = "0.1.0"
