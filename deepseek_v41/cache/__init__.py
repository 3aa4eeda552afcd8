"""KV cache: byte layouts and accounting, paged pools, window rings (SPEC.md §4.1)."""
