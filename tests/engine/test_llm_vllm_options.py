"""``LLM(...)`` takes vLLM's engine options with the meaning ``dsv41 serve``'s flags have (issue 23):
``gpu_memory_utilization`` sizes the KV pool budget from the free memory and the weights, ``tensor_parallel_size`` /
``pipeline_parallel_size`` only 1, ``kv_cache_dtype`` only ``auto``, ``trust_remote_code`` accepted; and vLLM's
``get_tokenizer()``, the dtype in force, and ``chat(chat_template_kwargs=..., add_generation_prompt=...)``.

Oracles: the pool's page size from a pool built without a budget, the weight bytes from the config (meta device),
and the official encoder's own rendering of the same conversation."""

import logging
import sys
from pathlib import Path

import pytest
import torch

from deepseek_v41.chat import encode_messages
from deepseek_v41.engine import LLM, SamplingParams
from deepseek_v41.engine import options as engine_options

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
from serving_helpers import save_tiny_model  # noqa: E402

SMALL = dict(max_model_len=128, max_num_seqs=2, block_size=16, enable_prefix_caching=False)
ONE = SamplingParams(temperature=0, max_tokens=1)
MESSAGES = [{"role": "user", "content": "Hello"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llm-options")
    save_tiny_model(path)
    return path


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model_dir, dtype="float32", **SMALL)


@pytest.mark.parametrize(("option", "message"), [
    ({"tensor_parallel_size": 2, "distributed_executor_backend": "uni"},
     "distributed_executor_backend 'uni' runs one process; 2 ranks need 'mp' or 'ray'"),
    ({"pipeline_parallel_size": 4}, "pipeline_parallel_size 4: no pipeline parallelism"),
    ({"kv_cache_dtype": "fp8"}, "kv_cache_dtype 'fp8' is not available: the KV cache format is fixed by the model"),
    ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization must be in (0, 1], got 1.5"),
    ({"gpu_memory_utilization": 0}, "gpu_memory_utilization must be in (0, 1], got 0"),
])
def test_vllm_options_refused_with_the_reason(model_dir, option, message):
    with pytest.raises(ValueError) as info:
        LLM(model_dir, **option, **SMALL)
    assert message in str(info.value)


def test_vllm_options_accepted(model_dir, llm):
    accepted = LLM(model_dir, dtype="float32", tensor_parallel_size=1, pipeline_parallel_size=1,
                   kv_cache_dtype="auto", trust_remote_code=True, **SMALL)
    prompt = {"prompt_token_ids": [3, 4, 5]}
    assert accepted.generate(prompt, ONE)[0].outputs[0].token_ids == llm.generate(prompt, ONE)[0].outputs[0].token_ids


@pytest.mark.parametrize(("fraction", "spare_pages", "pages"), [(1.0, 9, 9), (0.5, 18, 9), (0.9, 1000, 16)])
def test_gpu_memory_utilization_sizes_the_pool_as_serve_does(model_dir, llm, monkeypatch, caplog, fraction,
                                                             spare_pages, pages):
    """The budget is ``fraction`` x (free - weights), as ``dsv41 serve --gpu-memory-utilization``; the pool is the
    budget's pages, capped at max_num_seqs x max_model_len (2 x 128 / 16 = 16 pages), and the log says both."""
    page_bytes = llm.stats["kv_global_bytes"] // (llm.stats["kv_pages_total"] + 1)
    weights = engine_options.weight_bytes(model_dir, torch.float32)
    monkeypatch.setattr(engine_options, "free_memory_bytes", lambda device: weights + spare_pages * page_bytes)
    caplog.set_level(logging.INFO, logger="deepseek_v41")
    sized = LLM(model_dir, dtype="float32", gpu_memory_utilization=fraction, **SMALL)
    assert sized.stats["kv_pages_total"] == pages
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("gpu_memory_utilization"))
    assert "MiB at most" in line and f"allocated {pages} KV pages" in line and "= 16 pages" in line, line


def test_an_explicit_pool_size_wins_over_gpu_memory_utilization(model_dir, caplog):
    caplog.set_level(logging.INFO, logger="deepseek_v41")
    sized = LLM(model_dir, dtype="float32", gpu_memory_utilization=0.9, num_kv_pages=11, **SMALL)
    assert sized.stats["kv_pages_total"] == 11
    assert any("gpu_memory_utilization is ignored" in r.getMessage() for r in caplog.records)


def test_a_budget_too_small_for_one_sequence_says_where_it_came_from(model_dir, monkeypatch):
    weights = engine_options.weight_bytes(model_dir, torch.float32)
    monkeypatch.setattr(engine_options, "free_memory_bytes", lambda device: weights + 10)
    with pytest.raises(ValueError, match=r"cannot hold one sequence.*\(the budget of gpu_memory_utilization 0\.5"):
        LLM(model_dir, dtype="float32", gpu_memory_utilization=0.5, **SMALL)


def test_tokenizer_and_dtype_as_vllm(model_dir, caplog):
    caplog.set_level(logging.INFO, logger="deepseek_v41")
    loaded = LLM(model_dir, dtype="torch.float64", **SMALL)
    assert loaded.dtype == torch.float64
    assert loaded.get_tokenizer() is loaded.tokenizer and loaded.get_tokenizer().encode("Hello").ids
    assert any(r.getMessage().startswith("LLM: model") and "dtype torch.float64" in r.getMessage()
               for r in caplog.records), caplog.text


def test_chat_takes_vllms_keyword_arguments(llm):
    def prompt_of(**kwargs):
        return llm.chat(MESSAGES, ONE, use_tqdm=False, **kwargs)[0].prompt

    assert prompt_of(chat_template_kwargs={"thinking": True}) == encode_messages(MESSAGES, thinking=True)
    assert prompt_of(chat_template_kwargs={"enable_thinking": True, "reasoning_effort": "max"}) == \
        encode_messages(MESSAGES, thinking=True, reasoning_effort="max")
    assert prompt_of(thinking=True, chat_template_kwargs={"thinking": False}) == encode_messages(MESSAGES)
    assert prompt_of(add_generation_prompt=True) == encode_messages(MESSAGES)
    partial = [*MESSAGES, {"role": "assistant", "content": "Hi, I am"}]
    continued = llm.chat(partial, ONE, use_tqdm=False, add_generation_prompt=False, continue_final_message=True)
    assert continued[0].prompt == encode_messages([*MESSAGES, {**partial[-1], "wo_eos": True}])
    with pytest.raises(ValueError, match="add_generation_prompt=False is only supported with continue_final_message"):
        llm.chat(MESSAGES, ONE, add_generation_prompt=False)
    with pytest.raises(ValueError, match="continue_final_message needs an assistant message last"):
        llm.chat(MESSAGES, ONE, continue_final_message=True)
    with pytest.raises(ValueError, match=r"unknown chat_template_kwargs keys \['tokenize'\]"):
        llm.chat(MESSAGES, ONE, chat_template_kwargs={"tokenize": True})
    with pytest.raises(ValueError, match=r"chat_template_kwargs\['thinking'\] must be True or False"):
        llm.chat(MESSAGES, ONE, chat_template_kwargs={"thinking": "yes"})


def test_tokenizer_takes_a_folder_or_a_file(tmp_path):
    """vLLM's ``tokenizer=``: a folder with tokenizer.json (or the file) is loaded, not kept as a string; a folder
    without one is refused at construction, naming what is allowed."""
    import shutil
    from pathlib import Path

    from deepseek_v41 import LLM, SamplingParams

    bundled = Path(__file__).resolve().parents[2] / "checkpoints" / "v41-tiny"
    (tmp_path / "tok").mkdir()
    shutil.copy(bundled / "tokenizer.json", tmp_path / "tok" / "tokenizer.json")
    params = SamplingParams(temperature=0, max_tokens=2)
    want = LLM(str(bundled), dtype="float32", max_model_len=64).generate(["Hello"], params)[0].prompt_token_ids
    for given in (tmp_path / "tok", str(tmp_path / "tok" / "tokenizer.json")):
        llm = LLM(str(bundled), dtype="float32", max_model_len=64, tokenizer=given)
        assert llm.generate(["Hello"], params)[0].prompt_token_ids == want
    with pytest.raises(ValueError, match="no tokenizer.json there"):
        LLM(str(bundled), dtype="float32", max_model_len=64, tokenizer=str(tmp_path))


def test_a_file_that_is_no_tokenizer_is_refused_with_its_path():
    from pathlib import Path

    from deepseek_v41 import LLM

    bundled = Path(__file__).resolve().parents[2] / "checkpoints" / "v41-tiny"
    with pytest.raises(ValueError, match="config.json.* is not a tokenizer.json"):
        LLM(str(bundled), dtype="float32", max_model_len=64, tokenizer=str(bundled / "config.json"))


def test_engine_add_request_takes_token_ids_and_says_so():
    """vLLM's engine takes text too; ours takes token ids: a string (or non-int ids) gets a TypeError saying what
    to pass instead of a comparison error from inside."""
    from pathlib import Path

    from deepseek_v41 import LLM, SamplingParams

    llm = LLM(str(Path(__file__).resolve().parents[2] / "checkpoints" / "v41-tiny"), dtype="float32",
              max_model_len=64)
    for prompt in ("some text", [1, "2"], [1.0, 2.0]):
        with pytest.raises(TypeError, match="token ids"):
            llm.engine.add_request("a", prompt, SamplingParams(max_tokens=2))
    assert not llm.engine.has_unfinished_requests()
