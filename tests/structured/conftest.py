"""Fixtures of the structured-output tests: the bundled checkpoint's engines (plain and DSpark) and its tokenizer.

xgrammar and llguidance are dependencies: a missing one skips these tests locally and fails them under CI=true
(``require``)."""

from pathlib import Path

import pytest
from optional_deps import require

BUNDLED = Path(__file__).resolve().parents[2] / "checkpoints" / "v41-tiny"
ENGINE = dict(dtype="float32", max_model_len=512, max_num_seqs=8)


@pytest.fixture(scope="session")
def grammar_engines():
    """xgrammar and llguidance, imported (skip locally / fail in CI when missing)."""
    return require("xgrammar"), require("llguidance")


@pytest.fixture(scope="session")
def llm(grammar_engines):
    from deepseek_v41.engine import LLM

    return LLM(BUNDLED, **ENGINE)


@pytest.fixture(scope="session")
def spec_llm(grammar_engines):
    from deepseek_v41.engine import LLM

    return LLM(BUNDLED, **ENGINE, speculative="dspark", speculative_cost_table="fixed")


@pytest.fixture(scope="session")
def tokenizer():
    from deepseek_v41.engine.engine import load_tokenizer

    return load_tokenizer(BUNDLED)
