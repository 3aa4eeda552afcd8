"""The JSON-schema oracle of the structured-output tests: the package's validator, which knows no grammar
(:mod:`deepseek_v41.structured.schema_check`; ``dsv41 eval-chat`` checks tool arguments with it too)."""

from deepseek_v41.structured.schema_check import schema_errors as errors

__all__ = ["errors"]
