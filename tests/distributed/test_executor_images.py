"""Image prompts on the mp executor (issue 28): rank 0 preprocesses each image once and sends its patches (raw
float32 bytes in the step message) with the add event; every rank expands the same placeholders and encodes the
same pixels, so TP=2 gives one process's float64 tokens, and the encoder cache hits on a repeat."""

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from deepseek_v41 import LLM, SamplingParams

CKPT = Path(__file__).resolve().parents[2] / "checkpoints" / "v41-tiny-vl"
KW = dict(dtype="float64", max_model_len=512, max_num_batched_tokens=64)
PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.mark.slow  # ~5 s: .ci/run's slow tests
def test_image_prompt_on_two_ranks_matches_one_process():
    image = Image.fromarray((np.random.default_rng(0).random((40, 56, 3)) * 255).astype("uint8"))
    prompts = [{"prompt": "Look <｜deepseek_image｜> here", "multi_modal_data": {"image": [image]}}, "plain text"]
    expected = [o.outputs[0].token_ids for o in LLM(CKPT, **KW).generate(prompts, PARAMS, use_tqdm=False)]
    llm = LLM(CKPT, tensor_parallel_size=2, **KW)
    try:
        for _ in range(2):
            assert [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS, use_tqdm=False)] == expected
        assert llm.stats["encoder_cache"]["hits"] == 1
    finally:
        llm.shutdown()
