"""The server's ``--generation-config`` / ``--override-generation-config``: see
:mod:`deepseek_v41.engine.generation_config`, which reads the file for the server, ``dsv41 generate`` and ``LLM``
alike (the engine layer must not import the server's)."""

from deepseek_v41.engine.generation_config import (
    FILE,
    KEYS,
    SOURCES,
    GenerationConfigError,
    describe,
    load_sampling_defaults,
)

__all__ = ["FILE", "KEYS", "SOURCES", "GenerationConfigError", "describe", "load_sampling_defaults"]
