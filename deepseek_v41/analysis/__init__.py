"""Accounting computed from the code: KV bytes, parameters, FLOPs; plots (SPEC.md §5)."""
