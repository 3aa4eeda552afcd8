"""The DeepSeek-V4.1 model, one module per concept (SPEC.md §3)."""
