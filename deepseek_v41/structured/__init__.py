"""Structured outputs: grammars that constrain generation (JSON schemas, regexes, choices, DSML tool calls)."""
