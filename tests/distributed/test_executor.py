"""The mp executor (issue 28): ``LLM(..., tensor_parallel_size=2)`` runs rank 1 in a worker process (gloo on
127.0.0.1) and gives the greedy and seeded-sampling tokens of one process in float64, with chunked prefill, CED and
prefix hits read from disk by every rank; shutdown leaves no process. The protocol carries JSON and raw bytes
only. (Faults: test_executor_faults.py.)"""

import signal
from pathlib import Path

import pytest
from process_helpers import alive

from deepseek_v41 import LLM, SamplingParams
from deepseek_v41.distributed import protocol
from deepseek_v41.distributed.config import ParallelConfig
from deepseek_v41.distributed.executor import describe_exit
from deepseek_v41.engine.sampling_params import StructuredOutputsParams

CKPT = Path(__file__).resolve().parents[2] / "checkpoints" / "v41-tiny"
# max_num_batched_tokens 32: the 70- and 41-token prompts are prefilled in chunks.
KW = dict(dtype="float64", max_num_seqs=4, max_model_len=256, max_num_batched_tokens=32, block_size=16)
PROMPTS = [{"prompt_token_ids": [3 + (7 * i) % 200 for i in range(n)]} for n in (5, 70, 41)]
PARAMS = [SamplingParams(temperature=0, max_tokens=6),
          SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=6),
          SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)]


def tokens(outputs):
    return [[list(c.token_ids) for c in o.outputs] for o in outputs]


def worker_pids(llm) -> list[int]:
    return [proc.pid for proc in llm.engine.executor._procs.values()]


@pytest.fixture(scope="module")
def reference():
    llm = LLM(CKPT, **KW)
    return tokens(llm.generate(PROMPTS, PARAMS, use_tqdm=False))


def test_tp2_matches_one_process_and_reads_prefix_pages_from_disk(reference, tmp_path):
    llm = LLM(CKPT, tensor_parallel_size=2, distributed_executor_backend="mp", cache_dir=str(tmp_path / "cache"),
              **KW)
    pids = worker_pids(llm)
    try:
        assert llm.engine.prefill_mode.value == "ced" and len(pids) == 1
        assert tokens(llm.generate(PROMPTS, PARAMS, use_tqdm=False)) == reference
        # An aborted request in between: the workers replay the abort too (the next generate still agrees).
        llm.engine.add_request("gone", [5, 6, 7], SamplingParams(max_tokens=3))
        llm.engine.abort_request("gone")
        llm.engine.release("gone")
        # The device tier is dropped on every rank (an event); the pages rank 0 wrote come back from disk on both.
        assert llm.reset_prefix_cache()
        again = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        assert tokens(again) == reference
        assert again[1].num_cached_tokens >= 64 and llm.stats["prefix_cache"]["disk_pages_read"] >= 4
    finally:
        llm.shutdown()
    assert not any(alive(pid) for pid in pids)


def test_parallel_settings_refused_with_the_reason():
    with pytest.raises(ValueError, match="needs a model path"):
        LLM(object(), tensor_parallel_size=2)
    with pytest.raises(ValueError, match="tensor_parallel_size 2 and expert_parallel_size 4: each must be 1"):
        LLM(CKPT, tensor_parallel_size=2, expert_parallel_size=4)
    with pytest.raises(ValueError, match="'uni' runs one process; 2 ranks need 'mp' or 'ray'"):
        LLM(CKPT, tensor_parallel_size=2, distributed_executor_backend="uni")
    with pytest.raises(ValueError, match="redis_url is not served with several ranks"):
        LLM(CKPT, tensor_parallel_size=2, redis_url="redis://127.0.0.1:1/0")
    with pytest.raises(ValueError, match="--headless is for worker nodes"):
        ParallelConfig(tensor_parallel_size=2, headless=True).validate()


def test_protocol_is_json_and_bytes():
    params = SamplingParams(temperature=0.5, top_k=3, stop=["x"], seed=11, max_tokens=9,
                            structured_outputs=StructuredOutputsParams(choice=["a", "b"]))
    event = protocol.add_event("r1", [1, 2], params, "hi", 12.5, None)
    data = protocol.encode({"type": "step", "events": [event]}, [b"\x00\x01", b"abc"])
    header, blobs = protocol.decode(data)
    assert blobs == [b"\x00\x01", b"abc"] and b"pickle" not in data
    assert protocol.params_from_dict(header["events"][0]["params"]) == params
    with pytest.raises(ValueError, match="bad magic"):
        protocol.decode(b"\x80\x04pickled")
    assert describe_exit(-signal.SIGKILL) == "killed by SIGKILL" and describe_exit(3) == "exited with code 3"


def test_several_nodes_need_the_shared_secret(monkeypatch):
    """A key every node could work out alone, anyone reaching the port could too: several nodes need
    DSV41_DIST_AUTHKEY (one node gets a random key)."""
    from deepseek_v41.distributed.rank import AUTHKEY_ENV, authkey

    monkeypatch.delenv(AUTHKEY_ENV, raising=False)
    config = ParallelConfig(tensor_parallel_size=2, nnodes=2, master_port=29500)
    with pytest.raises(ValueError, match=AUTHKEY_ENV):
        authkey(config)
    assert authkey(ParallelConfig(tensor_parallel_size=2)) != authkey(ParallelConfig(tensor_parallel_size=2))
    monkeypatch.setenv(AUTHKEY_ENV, "s3cret")
    assert authkey(config) == b"s3cret"


def test_a_worker_tells_a_shutdown_from_a_driver_that_went_away():
    """``follow`` returns True after the driver's shutdown and False when the connection just closes (the worker
    then exits 1, so a headless node's supervisor sees the failure)."""
    from multiprocessing import Pipe

    from deepseek_v41.distributed.worker import follow

    ours, theirs = Pipe()
    protocol.send(theirs, {"type": "shutdown"})
    assert follow(ours, None, 1) is True
    theirs.close()
    assert follow(ours, None, 1) is False
