"""The package's top-level names, as vLLM users import them (issue 23)."""

import subprocess
import sys


def test_vllm_style_imports_without_torch_at_package_import():
    code = ("import sys, deepseek_v41; assert 'torch' not in sys.modules, 'import deepseek_v41 imported torch'; "
            "from deepseek_v41 import LLM, SamplingParams, load_model; "
            "from deepseek_v41.engine import LLM as E, SamplingParams as S; "
            "assert LLM is E and SamplingParams is S and callable(load_model); "
            "print(SamplingParams(max_tokens=3).max_tokens)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "3"


def test_unknown_name_is_an_attribute_error():
    import pytest

    import deepseek_v41

    with pytest.raises(AttributeError, match="no attribute 'NotAThing'"):
        deepseek_v41.NotAThing  # noqa: B018
